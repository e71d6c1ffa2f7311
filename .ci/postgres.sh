#!/usr/bin/env bash
# Install (if needed) and start a local PostgreSQL server for the registry tests; print its URL.
#
#   eval "$(bash .ci/postgres.sh)"    # exports MLXBUN_TEST_PG_URL=postgresql://mlxbun:mlxbun@127.0.0.1:<port>/mlxbun_test
#
# Idempotent: reuses an installed server, an existing cluster, role and database. Needs root
# (apt-get and `su postgres`). Everything it says goes to stderr except the final export line.
set -euo pipefail
log() { echo "postgres.sh: $*" >&2; }

if ! command -v pg_lsclusters >/dev/null 2>&1 || [ -z "$(ls /usr/lib/postgresql 2>/dev/null)" ]; then
  log "installing postgresql"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
fi

# The newest installed major version and its first cluster (create one when there is none).
version=$(ls /usr/lib/postgresql | sort -n | tail -1)
cluster=$(pg_lsclusters -h 2>/dev/null | awk -v v="$version" '$1 == v {print $2; exit}')
if [ -z "$cluster" ]; then
  cluster=main
  log "creating cluster $version/$cluster"
  pg_createcluster "$version" "$cluster" >&2
fi
port=$(pg_lsclusters -h | awk -v v="$version" -v c="$cluster" '$1 == v && $2 == c {print $3}')
status=$(pg_lsclusters -h | awk -v v="$version" -v c="$cluster" '$1 == v && $2 == c {print $4}')
if [ "$status" != "online" ]; then
  log "starting cluster $version/$cluster on port $port"
  pg_ctlcluster "$version" "$cluster" start >&2
fi
for _ in $(seq 1 30); do
  su postgres -c "psql -p $port -h 127.0.0.1 -d postgres -Atc 'select 1'" >/dev/null 2>&1 && break || true
  su postgres -c "psql -p $port -d postgres -Atc 'select 1'" >/dev/null 2>&1 && break
  sleep 1
done

psql_su() { su postgres -c "psql -p $port -d postgres -v ON_ERROR_STOP=1 -Atc \"$1\""; }
if [ "$(psql_su "select 1 from pg_roles where rolname='mlxbun'")" != "1" ]; then
  psql_su "create role mlxbun login password 'mlxbun' createdb" >&2
fi
if [ "$(psql_su "select 1 from pg_database where datname='mlxbun_test'")" != "1" ]; then
  psql_su "create database mlxbun_test owner mlxbun" >&2
fi
url="postgresql://mlxbun:mlxbun@127.0.0.1:$port/mlxbun_test"
log "ready: $url"
echo "export MLXBUN_TEST_PG_URL=$url"
