#!/usr/bin/env sh
# An optimised BLAS for `make bench` on Linux (bench/blas.py preloads it in place of the
# reference BLAS the mlx[cpu] wheel bundles): Debian's libopenblas0-pthread, installed only when no
# OpenBLAS is found. Never fails: without apt (or its rights) the bench runs on the bundled BLAS and
# its table head says so. Nothing to do on macOS (MLX uses Accelerate and Metal).
set -u
[ "$(uname -s)" = Linux ] || exit 0
[ "${MLX_SIDECAR_BLAS:-auto}" = auto ] || exit 0
for d in /usr/lib/*-linux-gnu /usr/lib64 /usr/lib /usr/local/lib; do
  for f in "$d"/openblas-pthread/libopenblas.so.0 "$d"/libopenblas.so.0 "$d"/openblas-openmp/libopenblas.so.0; do
    [ -f "$f" ] && exit 0
  done
done
if command -v apt-get >/dev/null 2>&1; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  export DEBIAN_FRONTEND=noninteractive
  if ! $SUDO apt-get install -y -qq --no-install-recommends libopenblas0-pthread >/dev/null 2>&1; then
    $SUDO apt-get update -qq >/dev/null 2>&1 &&
      $SUDO apt-get install -y -qq --no-install-recommends libopenblas0-pthread >/dev/null 2>&1
  fi && exit 0
fi
echo "ensure-openblas: no OpenBLAS (apt-get install libopenblas0-pthread); the bench uses the bundled reference BLAS" >&2
exit 0
