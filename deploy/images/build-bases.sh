#!/usr/bin/env bash
# Builds, from Debian's packages, the base images for hosts that cannot pull from a registry
# (mmdebstrap makes a root filesystem, `podman import` turns it into an image):
#   localhost/outbox/runtime:bookworm   glibc, CA roots and the unprivileged user 65532: the
#                                       RUNTIME_BASE of the Dockerfile (distroless stays its default)
#   localhost/outbox/postgres:15        Debian's PostgreSQL 15, with the docker-entrypoint.sh
#                                       subset deploy/compose.yaml uses (POSTGRES_DB, POSTGRES_PASSWORD_FILE)
#   localhost/outbox/redis:7            Debian's redis-server (7.0 on bookworm: our tested minimum)
# An image is rebuilt only when this script or an entrypoint changed (their hash is the
# image's label), so
# CI builds them once per machine. Needs root, mmdebstrap and podman.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# The recipe is this script and the entrypoints it installs.
recipe=$(cat "$0" "$here"/*-entrypoint.sh | sha256sum | cut -c1-16)
suite=bookworm
mirror=http://deb.debian.org/debian
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

current() {
  [ "$(podman image inspect --format '{{index .Labels "outbox.recipe"}}' "$1" 2>/dev/null)" = "$recipe" ]
}

# mmdebstrap hooks per image ($1 in a hook is the root filesystem being made).
hooks_for() {
  case "$2" in
    runtime)
      echo "--customize-hook=echo 'nonroot:x:65532:65532:nonroot:/home/nonroot:/usr/sbin/nologin' >>\"\$1/etc/passwd\""
      echo "--customize-hook=echo 'nonroot:x:65532:' >>\"\$1/etc/group\""
      echo "--customize-hook=install -d -o 65532 -g 65532 \"\$1/home/nonroot\""
      ;;
    postgres)
      echo "--essential-hook=mkdir -p \"\$1/etc/postgresql-common\" && echo 'create_main_cluster = false' >\"\$1/etc/postgresql-common/createcluster.conf\""
      echo "--customize-hook=install -m 755 '$here/postgres-entrypoint.sh' \"\$1/usr/local/bin/docker-entrypoint.sh\""
      ;;
    redis)
      echo "--customize-hook=install -m 755 '$here/redis-entrypoint.sh' \"\$1/usr/local/bin/docker-entrypoint.sh\""
      ;;
  esac
}

build() {
  local name=$1 kind=$2 packages=$3
  shift 3
  if current "$name"; then
    echo "build-bases: $name is current" >&2
    return
  fi
  echo "build-bases: building $name from Debian $suite ($packages)" >&2
  local hooks=()
  mapfile -t hooks < <(hooks_for "$name" "$kind")
  mmdebstrap --quiet --variant=essential --include="$packages" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "${hooks[@]}" "$suite" "$work/$kind.tar" "$mirror"
  podman import --change "LABEL outbox.recipe=$recipe" "$@" "$work/$kind.tar" "$name" >/dev/null
  rm -f "$work/$kind.tar"
}

build localhost/outbox/runtime:bookworm runtime ca-certificates \
  --change 'USER 65532:65532'
build localhost/outbox/postgres:15 postgres postgresql-15 \
  --change 'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV PGDATA=/var/lib/postgresql/data' \
  --change 'ENTRYPOINT ["docker-entrypoint.sh"]' --change 'CMD ["postgres"]' \
  --change 'STOPSIGNAL SIGINT'
build localhost/outbox/redis:7 redis redis-server \
  --change 'ENTRYPOINT ["docker-entrypoint.sh"]' --change 'CMD ["redis-server"]'
