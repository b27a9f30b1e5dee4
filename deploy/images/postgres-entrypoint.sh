#!/bin/sh
# The part of the official postgres image's entrypoint that deploy/compose.yaml relies on:
# a new data directory is initialised with the superuser's password from
# POSTGRES_PASSWORD_FILE and the database POSTGRES_DB; the server runs as postgres.
set -eu
[ "${1:-}" = postgres ] && shift
install -d -o postgres -g postgres -m 700 "$PGDATA"
install -d -o postgres -g postgres -m 2775 /var/run/postgresql
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  cat "$POSTGRES_PASSWORD_FILE" >"$pwfile"
  chown postgres "$pwfile"
  as_postgres initdb -D "$PGDATA" -U postgres --pwfile="$pwfile" --auth=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
  if [ -n "${POSTGRES_DB:-}" ] && [ "$POSTGRES_DB" != postgres ]; then
    echo "CREATE DATABASE \"$POSTGRES_DB\"" | as_postgres postgres --single -D "$PGDATA" postgres >/dev/null
  fi
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups postgres "$@"
