#!/usr/bin/env sh
# promtool and prometheus for the metrics and deploy tests: Debian's `prometheus` package (apt),
# or Homebrew's on macOS. Installs only what is missing; the packaged service is left stopped
# (the tests start their own server on loopback).
set -eu
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 && exit 0
if command -v apt-get >/dev/null 2>&1; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
elif command -v brew >/dev/null 2>&1; then
  brew install prometheus
else
  echo "ensure-prometheus: install Prometheus (promtool + prometheus) by hand; the metrics and deploy tests need it" >&2
  exit 1
fi
