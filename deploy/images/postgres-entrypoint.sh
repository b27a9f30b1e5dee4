#!/bin/sh
# The part of the official postgres image's entrypoint that deploy/compose.yaml relies on:
# a new data directory is initialised with the superuser's password from
# POSTGRES_PASSWORD_FILE and the database POSTGRES_DB; the server runs as postgres (PID 1).
# Until the marker is written, every start makes sure the database exists (a first start
# killed between initdb and CREATE DATABASE is finished by the next).
set -eu
[ "${1:-}" = postgres ] && shift
marker="$PGDATA/.outbox-initialised"
install -d -o postgres -g postgres -m 700 "$PGDATA"
install -d -o postgres -g postgres -m 2775 /var/run/postgresql
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  trap 'rm -f "$pwfile"' EXIT
  cat "$POSTGRES_PASSWORD_FILE" >"$pwfile"
  chown postgres "$pwfile"
  as_postgres initdb -D "$PGDATA" -U postgres --pwfile="$pwfile" --auth=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
fi
if [ ! -e "$marker" ]; then
  db=${POSTGRES_DB:-postgres}
  # Single-user mode exits 0 after a failed statement: connecting to the database is the check.
  if ! echo "SELECT 1" | as_postgres postgres --single -D "$PGDATA" "$db" >/dev/null 2>&1; then
    quoted=$(printf '%s' "$db" | sed 's/"/""/g')
    echo "CREATE DATABASE \"$quoted\"" | as_postgres postgres --single -D "$PGDATA" postgres >/dev/null
    echo "SELECT 1" | as_postgres postgres --single -D "$PGDATA" "$db" >/dev/null
  fi
  touch "$marker"
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups postgres "$@"
