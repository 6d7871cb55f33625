#!/usr/bin/env bash
# Starts a throwaway PostgreSQL cluster for the suite's PostgreSQL pass and prints the admin
# URL (TURNGUARD_TEST_PG). Installs Debian's server package when it is missing. The cluster
# lives in a temporary directory, listens on 127.0.0.1 only (trust auth: nothing but this
# machine can reach it) and is stopped by `.ci/postgres.sh stop DIR`.
set -euo pipefail
if [ "${1:-}" = "stop" ]; then
  dir="$2"
  su postgres -c "$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)/pg_ctl -D '$dir/db' -m fast stop" >/dev/null 2>&1 || true
  rm -rf "$dir"
  exit 0
fi
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql > /dev/null
fi
bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)"
port="${TURNGUARD_CI_PG_PORT:-55432}"
dir="$(mktemp -d /tmp/turnguard-pg.XXXXXX)"
chown postgres "$dir"
su postgres -c "$bin/initdb -D '$dir/db' -A trust -U postgres" > "$dir/initdb.log"
su postgres -c "$bin/pg_ctl -D '$dir/db' -l '$dir/server.log' -w -o \"-p $port -k '$dir' -c listen_addresses=127.0.0.1 -c max_connections=500\" start" > /dev/null
echo "$dir postgres://postgres@127.0.0.1:$port/postgres"
