#!/usr/bin/env bash
# Install the Debian tools some tests use when they exist (nginx, for the reverse-proxy
# example in config/nginx.conf). Never fails the caller: those tests skip without them.
set -u
command -v nginx >/dev/null 2>&1 && exit 0
command -v apt-get >/dev/null 2>&1 || { echo "install_test_tools: no apt-get, skipping"; exit 0; }
[ "$(id -u)" = "0" ] || { echo "install_test_tools: not root, skipping"; exit 0; }
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq nginx-light >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1; apt-get install -y -qq nginx-light >/dev/null 2>&1; } \
  && echo "install_test_tools: installed nginx-light" \
  || echo "install_test_tools: apt-get install failed, skipping"
exit 0
