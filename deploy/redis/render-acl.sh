#!/bin/sh
# Render users.acl for redis-server: replace each {{user}} with the SHA-256 of the password
# in <secrets-dir>/<user> (one file per user, trailing newline ignored), so plaintext
# passwords never reach the ACL file, and drop comments and blank lines (an ACL file has
# neither). Fails if a password file is missing or empty.
#
#   render-acl.sh <template> <secrets-dir> <output>
set -eu
[ $# -eq 3 ] || { echo "usage: $0 <template> <secrets-dir> <output>" >&2; exit 2; }
template=$1 secrets=$2 out=$3
tmp=$out.tmp.$$
grep -v -e '^#' -e '^[[:space:]]*$' "$template" >"$tmp"
for user in $(grep -o '{{[a-z_]*}}' "$tmp" | tr -d '{}' | sort -u); do
  file=$secrets/$user
  [ -s "$file" ] || { echo "render-acl: no password for Redis user '$user' (expected a non-empty file $file)" >&2; rm -f "$tmp"; exit 1; }
  hash=$(tr -d '\r\n' <"$file" | sha256sum | cut -d' ' -f1)
  sed -i "s/{{$user}}/$hash/g" "$tmp"
done
chmod 600 "$tmp"
mv "$tmp" "$out"
