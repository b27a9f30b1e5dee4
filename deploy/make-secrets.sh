#!/usr/bin/env bash
# Make what a deployment needs to start securely, into one directory (kept if present):
#   ca.pem, ca.key              a private CA (keep ca.key offline in production)
#   server.pem, server.key      a server certificate for the given names (Postgres, Redis)
#   postgres/<role>             a generated password per Postgres role
#   redis/<user>                a generated password per Redis ACL user
#   session/<side>              the key a side's instances sign page sessions with
#                               (CHAT_SESSION_KEY_FILE)
#   idp/key.pem, idp/jwks.json  a stand-in identity provider: an Ed25519 signing key and the
#                               JWKS the services verify tokens with (CHAT_JWKS_FILE). With
#                               your own provider, put its JWKS in idp/jwks.json instead;
#                               `chat-token` mints tokens with idp/key.pem for trying it out.
# Used by deploy/local.sh, and by hand for deploy/compose.yaml and deploy/k8s/ (see
# docs/deployment.md). With a managed Postgres or Redis, use their CA instead.
#
#   make-secrets.sh DIR NAME...      e.g. make-secrets.sh deploy/.secrets postgres redis localhost
#
# Files are created readable by their owner only, in a directory only the owner can enter;
# CONTAINER_READABLE=1 makes the files (not the directory) world-readable, so containers
# running as another uid can read their bind mounts.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 DIR NAME... (DNS names or IP addresses of the servers)" >&2; exit 2; }
dir=$1
shift
mkdir -p "$dir/postgres" "$dir/redis" "$dir/idp" "$dir/session"
chmod 700 "$dir"
umask 077

if [ ! -f "$dir/server.pem" ]; then
  sans=()
  for name in "$@"; do
    if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then sans+=("IP:$name"); else sans+=("DNS:$name"); fi
  done
  san=$(IFS=,; echo "${sans[*]}")
  log=$dir/openssl.log
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/CN=outbox chat CA" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>>"$log"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
    -keyout "$dir/server.key" -out "$dir/server.csr" 2>>"$log"
  printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n' "$san" >"$dir/server.ext"
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 825 -extfile "$dir/server.ext" -out "$dir/server.pem" 2>>"$log"
  rm -f "$dir/server.csr" "$dir/server.ext" "$dir/ca.srl"
fi

for f in postgres/postgres postgres/consumers postgres/workers postgres/consumers_relay postgres/workers_relay \
  redis/admin redis/consumers redis/workers redis/consumers_relay redis/workers_relay \
  session/consumers session/workers; do
  # Hex: safe in URLs, SQL literals and ACL files alike.
  [ -s "$dir/$f" ] || openssl rand -hex 24 >"$dir/$f"
done

if [ ! -f "$dir/idp/jwks.json" ]; then
  openssl genpkey -algorithm ed25519 -out "$dir/idp/key.pem" 2>>"$dir/openssl.log"
  # An Ed25519 public key in DER is a fixed 12-byte header and the 32-byte key: the JWK's
  # `x` is those 32 bytes, base64url without padding (RFC 8037).
  x=$(openssl pkey -in "$dir/idp/key.pem" -pubout -outform DER | tail -c 32 | base64 | tr '+/' '-_' | tr -d '=\n')
  printf '{"keys":[{"kty":"OKP","crv":"Ed25519","alg":"EdDSA","use":"sig","kid":"local-1","x":"%s"}]}\n' "$x" >"$dir/idp/jwks.json"
fi

chmod 644 "$dir/ca.pem" "$dir/server.pem" "$dir/idp/jwks.json"
if [ "${CONTAINER_READABLE:-0}" = 1 ]; then
  find "$dir" -type f ! -name ca.key -exec chmod 644 {} +
fi
