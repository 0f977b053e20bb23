#!/bin/sh
# Debian's prometheus keeps its data in /var/lib/prometheus/metrics2 unless told otherwise; the real
# image's server, given the compose file's arguments (which name no storage path), keeps it in data/ of
# its working directory /prometheus, the volume. So does this one: the arguments go to the server, with
# --storage.tsdb.path=/prometheus/data when they name none.
set -eu
for arg in "$@"; do
    case "$arg" in --storage.tsdb.path|--storage.tsdb.path=*) exec /usr/bin/prometheus "$@" ;; esac
done
exec /usr/bin/prometheus --storage.tsdb.path=/prometheus/data "$@"
