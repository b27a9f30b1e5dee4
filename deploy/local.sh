#!/usr/bin/env bash
# The whole system on this machine: a private Postgres and Redis (configured with the files
# in deploy/postgres and deploy/redis), the migrations, both relays and both services.
# Prints the two chat pages; Ctrl-C stops everything, services first, Postgres last.
#
# State (data, logs) lives in $CHAT_LOCAL_DIR (default: .local/ in the repository) and is
# kept between runs. Ports: CONSUMERS_PORT (8081), WORKERS_PORT (8082), relay admin
# CONSUMERS_RELAY_ADMIN (9181) and WORKERS_RELAY_ADMIN (9182). CHAT_LOCAL_PROFILE=debug uses
# debug builds.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
state=${CHAT_LOCAL_DIR:-$root/.local}
profile=${CHAT_LOCAL_PROFILE:-release}
consumers_port=${CONSUMERS_PORT:-8081}
workers_port=${WORKERS_PORT:-8082}
consumers_admin=${CONSUMERS_RELAY_ADMIN:-9181}
workers_admin=${WORKERS_RELAY_ADMIN:-9182}
pg_bin=/usr/lib/postgresql/15/bin

log() { printf '[local] %s\n' "$*" >&2; }

"$root/deploy/install-deps.sh"

log "building ($profile)"
if [ "$profile" = release ]; then
  cargo build --release --quiet --manifest-path "$root/Cargo.toml" -p cdc-relay -p chat-services -p outbox-migrations
else
  cargo build --quiet --manifest-path "$root/Cargo.toml" -p cdc-relay -p chat-services -p outbox-migrations
fi
bin=$root/target/$profile

mkdir -p "$state/logs" "$state/redis" "$state/pg/socket"
pids=()
names=()

# Postgres refuses to run as root: as root, run its programs as the postgres user.
as_postgres=()
[ "$(id -u)" -eq 0 ] && as_postgres=(setpriv --reuid=postgres --regid=postgres --init-groups --)

stop_all() {
  trap - INT TERM EXIT
  log "stopping"
  # Reverse start order: services, relays (final acknowledgement), Redis, Postgres.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    pid=${pids[$i]}
    if kill -0 "$pid" 2>/dev/null; then
      if [ "${names[$i]}" = postgres ]; then kill -INT "$pid"; else kill -TERM "$pid"; fi
      for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && { log "${names[$i]} did not stop; killing"; kill -KILL "$pid"; }
      wait "$pid" 2>/dev/null || true
      log "stopped ${names[$i]}"
    fi
  done
}
trap 'stop_all; exit 0' INT TERM
trap stop_all EXIT

start() { # name, command...
  local name=$1
  shift
  # A session of its own: Ctrl-C reaches only this script, which stops children in order.
  setsid "$@" >>"$state/logs/$name.log" 2>&1 &
  pids+=($!)
  names+=("$name")
}

wait_for() { # what, seconds, command...
  local what=$1 seconds=$2
  shift 2
  for _ in $(seq 1 $((seconds * 10))); do
    "$@" >/dev/null 2>&1 && return 0
    for i in "${!pids[@]}"; do
      kill -0 "${pids[$i]}" 2>/dev/null || { log "${names[$i]} exited; see $state/logs/${names[$i]}.log"; tail -5 "$state/logs/${names[$i]}.log" >&2; exit 1; }
    done
    sleep 0.1
  done
  log "timed out waiting for $what"
  exit 1
}

http_ok() { # port path: 200?
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'GET %s HTTP/1.0\r\nHost: localhost\r\n\r\n' "$2" >&3
  local status
  read -r _ status _ <&3 || true
  exec 3<&- 3>&-
  [ "$status" = 200 ]
}

# Postgres: a private cluster over a Unix socket, trust auth for local connections.
if [ ! -f "$state/pg/data/PG_VERSION" ]; then
  log "initializing Postgres in $state/pg/data"
  mkdir -p "$state/pg/data"
  [ "$(id -u)" -eq 0 ] && chown -R postgres:postgres "$state/pg"
  "${as_postgres[@]}" "$pg_bin/initdb" -D "$state/pg/data" -U postgres --auth=trust --encoding=UTF8 --locale=C >"$state/logs/initdb.log"
  echo "include '$root/deploy/postgres/postgresql.conf'" >>"$state/pg/data/postgresql.conf"
fi
[ "$(id -u)" -eq 0 ] && chown -R postgres:postgres "$state/pg"
socket=$state/pg/socket
start postgres "${as_postgres[@]}" "$pg_bin/postgres" -D "$state/pg/data" -c listen_addresses= -c unix_socket_directories="$socket" -c port=5432
wait_for "Postgres" 60 "$pg_bin/pg_isready" -q -h "$socket" -p 5432 -U postgres

start redis redis-server "$root/deploy/redis/redis.conf" --port 0 --unixsocket "$state/redis/redis.sock" --unixsocketperm 700 --dir "$state/redis"
wait_for "Redis" 30 redis-cli -s "$state/redis/redis.sock" ping

host=$(printf '%s' "$socket" | sed 's|/|%2F|g')
url() { printf 'postgres://%s@%s:5432/chat' "$1" "$host"; }
redis_url="redis+unix://$state/redis/redis.sock"

"$pg_bin/psql" -q -h "$socket" -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'chat'" | grep -q 1 \
  || "$pg_bin/createdb" -h "$socket" -U postgres chat
"$bin/migrate" --database-url "$(url postgres)" >>"$state/logs/migrate.log" 2>&1
log "migrations applied"

for side in consumers workers; do
  admin_var=${side}_admin
  relay_args=(--database-url "$(url "${side}_relay")" --slot "${side}_relay" --publication "${side}_outbox"
    --outbox-table "$side.outbox" --redis-url "$redis_url" --stream "outbox:$side")
  "$bin/cdc-relay" setup "${relay_args[@]}" >>"$state/logs/relay-$side.log" 2>&1
  start "relay-$side" "$bin/cdc-relay" run "${relay_args[@]}" --admin-addr "127.0.0.1:${!admin_var}"
done
for side in consumers workers; do
  wait_for "relay $side" 60 http_ok "$([ $side = consumers ] && echo "$consumers_admin" || echo "$workers_admin")" /readyz
done

start consumers "$bin/chat-service" --side consumers --database-url "$(url consumers)" --redis-url "$redis_url" \
  --listen "127.0.0.1:$consumers_port" --consumer-name consumers-local
start workers "$bin/chat-service" --side workers --database-url "$(url workers)" --redis-url "$redis_url" \
  --listen "127.0.0.1:$workers_port" --consumer-name workers-local
wait_for "consumers" 60 http_ok "$consumers_port" /readyz
wait_for "workers" 60 http_ok "$workers_port" /readyz

cat <<MSG

  Consumers chat: http://127.0.0.1:$consumers_port/
  Workers chat:   http://127.0.0.1:$workers_port/

  relay metrics:  http://127.0.0.1:$consumers_admin/metrics  http://127.0.0.1:$workers_admin/metrics
  logs:           $state/logs/
  Ctrl-C stops everything.

MSG

# Run until Ctrl-C, or until a component exits on its own (then stop the rest).
wait -n "${pids[@]}" || true
for i in "${!pids[@]}"; do
  kill -0 "${pids[$i]}" 2>/dev/null || log "${names[$i]} exited; see $state/logs/${names[$i]}.log"
done
exit 1
