#!/bin/sh
# The official image builds redis-server with protected mode off; Debian's keeps it on,
# which refuses clients from other containers. Everything else runs as given.
set -e
if [ "$1" = "redis-server" ]; then
    shift
    exec setpriv --reuid=redis --regid=redis --init-groups redis-server "$@" --protected-mode no
fi
exec "$@"
