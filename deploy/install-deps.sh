#!/usr/bin/env bash
# Installs, when missing, the system packages the tests and the local stack need on Debian:
# the Postgres 15 server binaries, redis-server, Chromium and ChromeDriver (the chat page's
# browser test), promtool, openssl, and a C toolchain for crates that build C.
# Our tests and the local stack start private instances; the packaged services are not used.
set -euo pipefail

need=()
[ -x /usr/lib/postgresql/15/bin/postgres ] || need+=(postgresql-15)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# redis-cli creates the test Redis Clusters (redis-cli --cluster create).
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v setpriv >/dev/null 2>&1 || need+=(util-linux)
# The local stack makes its CA, certificates and passwords with openssl.
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
# The chat page is tested in a real headless browser.
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)

# promtool checks the metrics output and the alert rules (Debian ships it with prometheus).
command -v promtool >/dev/null 2>&1 || need+=(prometheus)

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install-deps: missing packages ${need[*]}; run as root (or install them) first" >&2
    exit 1
  fi
  echo "install-deps: installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Install only: do not start the packaged services (Postgres, Redis, Prometheus); the tests
  # and the local stack run their own private instances.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
