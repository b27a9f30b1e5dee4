#!/bin/sh
# The part of the official redis image's entrypoint that deploy/compose.yaml relies on: the
# server runs as the redis user and owns its data directory.
set -eu
install -d -o redis -g redis /data
cd /data
exec setpriv --reuid=redis --regid=redis --init-groups "$@"
