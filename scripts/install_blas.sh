#!/usr/bin/env bash
# Install Debian's OpenBLAS when this is a Debian-like Linux and we are root: an
# option, the loader's second choice (veloxquant_mlx/cpu_backend.py) after the
# scipy-openblas32 wheel that pip installs. Never fails the caller: without it
# everything still works.
set -u
[ "$(uname -s)" = "Linux" ] || exit 0
lib=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
[ -e "$lib" ] && exit 0
ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1 && exit 0
command -v apt-get >/dev/null 2>&1 || { echo "install_blas: no apt-get, skipping"; exit 0; }
[ "$(id -u)" = "0" ] || { echo "install_blas: not root, skipping"; exit 0; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || true
apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
  && echo "install_blas: installed libopenblas0-pthread" \
  || echo "install_blas: apt-get install failed, skipping"
exit 0
