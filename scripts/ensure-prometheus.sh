#!/usr/bin/env sh
# The tools the metrics and deploy tests run for real: promtool and prometheus (Debian's
# `prometheus` package, or Homebrew's on macOS) and, on Linux, systemd-analyze (Debian's `systemd`)
# to verify the systemd unit. Installs only what is missing; the packaged Prometheus service is
# left stopped (the tests start their own server on loopback).
set -eu
need=
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || need="prometheus"
[ "$(uname -s)" != Linux ] || command -v systemd-analyze >/dev/null 2>&1 || need="$need systemd"
[ -n "$need" ] || exit 0
if command -v apt-get >/dev/null 2>&1; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086
  $SUDO apt-get install -y -qq --no-install-recommends $need >/dev/null
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
elif command -v brew >/dev/null 2>&1; then
  brew install prometheus
else
  echo "ensure-prometheus: install Prometheus (promtool + prometheus) by hand; the metrics and deploy tests need it" >&2
  exit 1
fi
