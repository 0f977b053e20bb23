#!/bin/sh
# What the stand-in keeps of the real image's entrypoint (docker-entrypoint.sh, the name it also answers
# to): a new data directory gets a superuser POSTGRES_USER (password POSTGRES_PASSWORD, or the file
# POSTGRES_PASSWORD_FILE names, read as root; scram over TCP) and a database POSTGRES_DB; the server
# listens on every address of the container and runs as postgres, with the command's arguments.
set -eu
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    POSTGRES_PASSWORD=$(cat "$POSTGRES_PASSWORD_FILE")
    export POSTGRES_PASSWORD
    unset POSTGRES_PASSWORD_FILE
fi
if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /run/postgresql
    chown -R postgres:postgres "$PGDATA" /run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE must be set}" > "$pwfile"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$db" != postgres ]; then
        pg_ctl -D "$PGDATA" -w -o "-c listen_addresses=''" start >/dev/null
        createdb -U "$user" "$db"
        pg_ctl -D "$PGDATA" -w -m fast stop >/dev/null
    fi
fi
exec "$@" -D "$PGDATA"
