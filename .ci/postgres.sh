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
dir="$(mktemp -d /tmp/turnguard-pg.XXXXXX)"
chown postgres "$dir"
su postgres -c "$bin/initdb -D '$dir/db' -A trust -U postgres" > "$dir/initdb.log"
# The first free port from TURNGUARD_CI_PG_PORT (default 55432) up: a port another server holds
# (a cluster left by an earlier run, a service the machine started) would make pg_ctl fail.
# A start that fails for any other reason prints the server's log, so CI shows why.
port="${TURNGUARD_CI_PG_PORT:-55432}"
for attempt in 1 2 3 4 5 6 7 8; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    port=$((port + 1))
    continue
  fi
  if su postgres -c "$bin/pg_ctl -D '$dir/db' -l '$dir/server.log' -w -t 120 -o \"-p $port -k '$dir' -c listen_addresses=127.0.0.1 -c max_connections=500\" start" > "$dir/pg_ctl.log" 2>&1; then
    echo "$dir postgres://postgres@127.0.0.1:$port/postgres"
    exit 0
  fi
  echo "postgres.sh: the cluster did not start on port $port (attempt $attempt); its log:" >&2
  cat "$dir/pg_ctl.log" "$dir/server.log" >&2 || true
  # A start that timed out may leave its server running and holding the data directory.
  su postgres -c "$bin/pg_ctl -D '$dir/db' -m immediate stop" > /dev/null 2>&1 || true
  : > "$dir/server.log"
  port=$((port + 1))
done
echo "postgres.sh: no PostgreSQL cluster could be started" >&2
exit 1
