#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the cluster tests and print how to reach it:
#
#     eval "$(bash .ci/postgres.sh)"      # exports KILN_TEST_PG_DSN and KILN_TEST_PG_DIR
#     bash .ci/postgres.sh stop           # stops the server in $KILN_TEST_PG_DIR, removes it
#
# Installs PostgreSQL with apt-get when it is missing (as root; set PG_NO_INSTALL=1 to skip).
# The server is a fresh cluster in a temp dir, listening on 127.0.0.1 only, trust auth.
# On any failure it explains on stderr, prints nothing to eval, and exits 0 — the tests that
# need it then skip with a reason.
set -u

log() { echo "postgres.sh: $*" >&2; }

as_owner() {  # PostgreSQL refuses to run as root: use the postgres user there
    if [ "$(id -u)" = 0 ]; then
        runuser -u "$PG_USER" -- "$@"
    else
        "$@"
    fi
}

if [ "${1:-}" = "stop" ]; then
    dir="${2:-${KILN_TEST_PG_DIR:-}}"
    [ -n "$dir" ] && [ -d "$dir/data" ] || { log "nothing to stop"; exit 0; }
    bin=$(cat "$dir/bindir" 2>/dev/null || dirname "$(command -v pg_ctl)")
    PG_USER=$(stat -c %U "$dir/data")
    as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >&2 || true
    rm -rf "$dir"
    exit 0
fi

find_bin() {
    local d
    for d in /usr/lib/postgresql/*/bin; do
        if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; fi
    done | sort -V | tail -n 1
    if command -v initdb >/dev/null 2>&1; then dirname "$(command -v initdb)"; fi
}

bin=$(find_bin | head -n 1)
if [ -z "$bin" ]; then
    if [ "${PG_NO_INSTALL:-0}" = 1 ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "PostgreSQL is not installed and cannot be installed here; PostgreSQL tests will skip"
        exit 0
    fi
    log "installing PostgreSQL with apt-get"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends postgresql; } >&2; then
        log "apt-get could not install PostgreSQL; PostgreSQL tests will skip"
        exit 0
    fi
    bin=$(find_bin | head -n 1)
    [ -n "$bin" ] || { log "no initdb after installing; PostgreSQL tests will skip"; exit 0; }
fi

PG_USER=$(id -un)
if [ "$(id -u)" = 0 ]; then
    PG_USER=postgres
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres >&2 || {
        log "no postgres user to run the server as; PostgreSQL tests will skip"; exit 0; }
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/kiln-pg.XXXXXX") || { log "mktemp failed"; exit 0; }
echo "$bin" > "$dir/bindir"
chmod 755 "$dir"
[ "$(id -u)" = 0 ] && chown "$PG_USER" "$dir"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

if ! as_owner "$bin/initdb" -D "$dir/data" -A trust -U kiln --no-sync -E UTF8 >"$dir/initdb.log" 2>&1; then
    log "initdb failed (see below); PostgreSQL tests will skip"; cat "$dir/initdb.log" >&2
    rm -rf "$dir"; exit 0
fi
opts="-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c full_page_writes=off"
if ! as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -o "$opts" -w -t 60 start >&2; then
    log "the server did not start (see below); PostgreSQL tests will skip"; cat "$dir/server.log" >&2
    rm -rf "$dir"; exit 0
fi
echo "export KILN_TEST_PG_DSN=postgresql://kiln@127.0.0.1:$port/postgres"
echo "export KILN_TEST_PG_DIR=$dir"
