#!/usr/bin/env bash
# The whole system on this machine, configured as in production: a private Postgres and
# Redis (with the files in deploy/postgres and deploy/redis: TLS only, SCRAM passwords, the
# Redis ACL users), the migrations, both relays and both services, every connection over
# TLS verified against a local CA and every credential from a file.
# Prints the two chat pages and a sign-in link for a user of each (alice and bob, members
# of chat 7: tokens of a stand-in identity provider); Ctrl-C stops everything, services
# first, Postgres last.
#
# State (data, logs, the local CA, generated passwords) lives in $CHAT_LOCAL_DIR (default:
# .local/ in the repository) and is kept between runs. Ports (loopback only): CONSUMERS_PORT
# (8081), WORKERS_PORT (8082), relay admin CONSUMERS_RELAY_ADMIN (9181) and
# WORKERS_RELAY_ADMIN (9182), PG_PORT (54329), REDIS_PORT (63790).
# CHAT_LOCAL_PROFILE=debug uses debug builds; CHAT_LOCAL_BIN=DIR uses the binaries in DIR
# and builds nothing. Run as root (Postgres runs as `postgres`).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
state=${CHAT_LOCAL_DIR:-$root/.local}
profile=${CHAT_LOCAL_PROFILE:-release}
consumers_port=${CONSUMERS_PORT:-8081}
workers_port=${WORKERS_PORT:-8082}
consumers_admin=${CONSUMERS_RELAY_ADMIN:-9181}
workers_admin=${WORKERS_RELAY_ADMIN:-9182}
consumers_service_admin=${CONSUMERS_ADMIN:-9191}
workers_service_admin=${WORKERS_ADMIN:-9192}
pg_port=${PG_PORT:-54329}
redis_port=${REDIS_PORT:-63790}
pg_bin=/usr/lib/postgresql/15/bin
# The stand-in identity provider's issuer (its key is made by make-secrets.sh).
idp_issuer=http://localhost/local-idp

log() { printf '[local] %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  log "run as root: Postgres runs as the postgres user, administered over its socket (peer auth)"
  exit 1
fi

"$root/deploy/install-deps.sh" --local

if [ -n "${CHAT_LOCAL_BIN:-}" ]; then
  # Binaries built already (the test of this script: a build here would replace the ones
  # the other tests run, built with other features).
  bin=$CHAT_LOCAL_BIN
else
  log "building ($profile)"
  if [ "$profile" = release ]; then
    cargo build --release --quiet --manifest-path "$root/Cargo.toml" -p cdc-relay -p chat-services
  else
    cargo build --quiet --manifest-path "$root/Cargo.toml" -p cdc-relay -p chat-services
  fi
  bin=$root/target/$profile
fi

mkdir -p "$state/logs" "$state/redis" "$state/pg/socket"
pids=()
names=()

# Postgres refuses to run as root: run its programs as the postgres user.
as_postgres=(setpriv --reuid=postgres --regid=postgres --init-groups --)

# A local CA, a server certificate for localhost (Postgres and Redis) and a generated
# password per Postgres role and Redis user, made once.
secrets=$state/secrets
"$root/deploy/make-secrets.sh" "$secrets" localhost 127.0.0.1
# Postgres reads its key as the postgres user and wants it private.
mkdir -p "$state/pg/tls"
cp "$secrets/server.pem" "$secrets/server.key" "$state/pg/tls/"

stop_all() {
  trap - INT TERM HUP EXIT
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
trap 'stop_all; exit 0' INT TERM HUP
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

http_put() { # port path token: prints the status of PUT path with that bearer token
  exec 3<>"/dev/tcp/127.0.0.1/$1" || { echo 000; return; }
  printf 'PUT %s HTTP/1.0\r\nHost: localhost\r\nAuthorization: Bearer %s\r\nContent-Length: 0\r\n\r\n' "$2" "$3" >&3
  local status
  read -r _ status _ <&3 || true
  exec 3<&- 3>&-
  echo "${status:-000}"
}

http_ok() { # port path: 200?
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'GET %s HTTP/1.0\r\nHost: localhost\r\n\r\n' "$2" >&3
  local status
  read -r _ status _ <&3 || true
  exec 3<&- 3>&-
  [ "$status" = 200 ]
}

# Postgres: a private cluster with the deploy configuration, TLS on 127.0.0.1:$pg_port.
if [ ! -f "$state/pg/data/PG_VERSION" ]; then
  log "initializing Postgres in $state/pg/data"
  mkdir -p "$state/pg/data"
  chown -R postgres:postgres "$state/pg"
  "${as_postgres[@]}" "$pg_bin/initdb" -D "$state/pg/data" -U postgres --auth-local=peer --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C >"$state/logs/initdb.log"
  echo "include '$root/deploy/postgres/postgresql.conf'" >>"$state/pg/data/postgresql.conf"
fi
chown -R postgres:postgres "$state/pg"
chmod 600 "$state/pg/tls/server.key"
socket=$state/pg/socket
start postgres "${as_postgres[@]}" "$pg_bin/postgres" -D "$state/pg/data" -c listen_addresses=127.0.0.1 -c port="$pg_port" \
  -c unix_socket_directories="$socket" -c hba_file="$root/deploy/postgres/pg_hba.conf" \
  -c ssl_cert_file="$state/pg/tls/server.pem" -c ssl_key_file="$state/pg/tls/server.key"
wait_for "Postgres" 60 "$pg_bin/pg_isready" -q -h "$socket" -p "$pg_port" -U postgres

# Administration over the socket as the postgres user (peer auth): the superuser's password
# for the migrations, which connect like everyone else (TLS, SCRAM) and make one database per
# side (chat_consumers, chat_workers).
psql_admin() { "${as_postgres[@]}" "$pg_bin/psql" -q -X -v ON_ERROR_STOP=1 -h "$socket" -p "$pg_port" -U postgres -d postgres "$@"; }
# The previous layout kept both sides in one database, `chat`: its slots would hold WAL for
# ever, and their names are the ones each side's relay makes now. Local data only: dropped.
if psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = 'chat'" | grep -q 1; then
  log "dropping the previous layout's database chat (one database per side now)"
  psql_admin -tAc "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = 'chat'" >/dev/null
  psql_admin -c "DROP DATABASE chat"
fi
# On stdin, not the command line, so the password never shows in the process list.
printf "ALTER ROLE postgres PASSWORD '%s'" "$(cat "$secrets/postgres/postgres")" | psql_admin

# Redis: the deploy configuration and ACL users, TLS on 127.0.0.1:$redis_port.
"$root/deploy/redis/render-acl.sh" "$root/deploy/redis/users.acl" "$secrets/redis" "$state/redis/users.acl"
start redis redis-server "$root/deploy/redis/redis.conf" --bind 127.0.0.1 --port 0 --tls-port "$redis_port" \
  --tls-cert-file "$secrets/server.pem" --tls-key-file "$secrets/server.key" --tls-ca-cert-file "$secrets/ca.pem" \
  --aclfile "$state/redis/users.acl" --dir "$state/redis"
redis_ping() { REDISCLI_AUTH=$(cat "$secrets/redis/admin") redis-cli --tls --cacert "$secrets/ca.pem" -h localhost -p "$redis_port" --user admin --no-auth-warning ping | grep -q PONG; }
wait_for "Redis" 30 redis_ping

# Every client: TLS verified against the local CA, its password from a file.
export DATABASE_CA_FILE=$secrets/ca.pem REDIS_CA_FILE=$secrets/ca.pem
url() { printf 'postgres://%s@localhost:%s/%s?sslmode=verify-full' "$1" "$pg_port" "$2"; }
redis_url() { printf 'rediss://%s@localhost:%s' "$1" "$redis_port"; }

role_passwords=()
for role in consumers workers consumers_relay workers_relay; do
  role_passwords+=(--role-password "$role=$secrets/postgres/$role")
done
# The admin step also loads the Redis functions, as Redis's admin: the services' (migrate)
# and the relays' (cdc-relay functions). Their own users may only call them.
DATABASE_PASSWORD_FILE=$secrets/postgres/postgres REDIS_PASSWORD_FILE=$secrets/redis/admin "$bin/migrate" \
  --database-url "$(url postgres postgres)" --redis-url "$(redis_url admin)" \
  --side-database consumers=chat_consumers --side-database workers=chat_workers "${role_passwords[@]}" \
  >>"$state/logs/migrate.log" 2>&1 || { log "migrations failed; see $state/logs/migrate.log"; tail -3 "$state/logs/migrate.log" >&2; exit 1; }
REDIS_PASSWORD_FILE=$secrets/redis/admin "$bin/cdc-relay" functions --redis-url "$(redis_url admin)" \
  >>"$state/logs/migrate.log" 2>&1 || { log "loading the relays' Redis functions failed; see $state/logs/migrate.log"; tail -3 "$state/logs/migrate.log" >&2; exit 1; }
log "migrations applied, Redis functions loaded"

for side in consumers workers; do
  admin_var=${side}_admin
  relay_args=(--database-url "$(url "${side}_relay" "chat_$side")" --slot "${side}_relay" --publication "${side}_outbox"
    --outbox-table "$side.outbox" --redis-url "$(redis_url "${side}_relay")" --stream "outbox:$side")
  export DATABASE_PASSWORD_FILE=$secrets/postgres/${side}_relay REDIS_PASSWORD_FILE=$secrets/redis/${side}_relay
  "$bin/cdc-relay" setup "${relay_args[@]}" >>"$state/logs/relay-$side.log" 2>&1 \
    || { log "relay setup failed; see $state/logs/relay-$side.log"; tail -3 "$state/logs/relay-$side.log" >&2; exit 1; }
  start "relay-$side" "$bin/cdc-relay" run "${relay_args[@]}" --on-lost-slot recover --admin-addr "127.0.0.1:${!admin_var}"
done
for side in consumers workers; do
  wait_for "relay $side" 60 http_ok "$([ $side = consumers ] && echo "$consumers_admin" || echo "$workers_admin")" /readyz
done

# Served over plain HTTP on 127.0.0.1 (development): the session cookie cannot be `Secure`
# there for every browser, hence --cookie-secure=false (never behind a public listener).
for side in consumers workers; do
  port_var=${side}_port
  service_admin_var=${side}_service_admin
  export DATABASE_PASSWORD_FILE=$secrets/postgres/$side REDIS_PASSWORD_FILE=$secrets/redis/$side
  start "$side" "$bin/chat-service" --side "$side" --database-url "$(url "$side" "chat_$side")" --redis-url "$(redis_url "$side")" \
    --listen "127.0.0.1:${!port_var}" --admin-addr "127.0.0.1:${!service_admin_var}" --consumer-name "$side-local" \
    --jwks-file "$secrets/idp/jwks.json" --jwt-issuer "$idp_issuer" --jwt-type at+jwt \
    --jwt-audience "chat-$side" --jwt-admin-audience "chat-$side-admin" \
    --session-key-file "$secrets/session/$side" --cookie-secure=false
done
unset DATABASE_PASSWORD_FILE REDIS_PASSWORD_FILE
wait_for "consumers" 60 http_ok "$consumers_service_admin" /readyz
wait_for "workers" 60 http_ok "$workers_service_admin" /readyz

# Who is who: alice on the Consumers side and bob on the Workers side, both in chat 7, each
# signed in by the link printed below (a token of the stand-in identity provider).
# Each side has an audience of its own, and one for its admins: a token of one side is
# refused on the other, and an admin token is no user's.
mint() { "$bin/chat-token" --key "$secrets/idp/key.pem" mint --issuer "$idp_issuer" "$@"; }
for member in "$consumers_port alice consumers" "$workers_port bob workers"; do
  read -r port user side <<<"$member"
  admin_token=$(mint --audience "chat-$side-admin" --sub local-admin --scope chat:admin --ttl 5m)
  status=$(http_put "$port" "/chats/7/members/$user" "$admin_token")
  case $status in 200|201) ;; *) log "adding $user to chat 7 answered $status"; exit 1 ;; esac
done
# Bearer tokens: readable by their owner only.
(umask 077 && mkdir -p "$state/tokens" \
  && mint --audience chat-consumers --sub alice >"$state/tokens/alice" \
  && mint --audience chat-workers --sub bob >"$state/tokens/bob")
log "chat 7 has alice (consumers) and bob (workers); tokens in $state/tokens/"

cat <<MSG

  Consumers chat: http://127.0.0.1:$consumers_port/
  Workers chat:   http://127.0.0.1:$workers_port/

  Sign in (tokens valid 8 h, in $state/tokens/):
    alice at Consumers: http://127.0.0.1:$consumers_port/#chat=7&token=$(cat "$state/tokens/alice")
    bob at Workers:     http://127.0.0.1:$workers_port/#chat=7&token=$(cat "$state/tokens/bob")

  relay metrics:  http://127.0.0.1:$consumers_admin/metrics  http://127.0.0.1:$workers_admin/metrics
  service admin:  http://127.0.0.1:$consumers_service_admin/metrics  http://127.0.0.1:$workers_service_admin/metrics
  logs:           $state/logs/
  credentials:    $state/secrets/ (Postgres on localhost:$pg_port, Redis on localhost:$redis_port, CA $secrets/ca.pem)
  Ctrl-C stops everything.

MSG

# Run until Ctrl-C, or until a component exits on its own (then stop the rest).
wait -n "${pids[@]}" || true
for i in "${!pids[@]}"; do
  kill -0 "${pids[$i]}" 2>/dev/null || log "${names[$i]} exited; see $state/logs/${names[$i]}.log"
done
exit 1
