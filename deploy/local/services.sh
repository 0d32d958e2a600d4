#!/usr/bin/env bash
# Makes sure PostgreSQL and Redis run locally for `make run` and `make test`: installs them from
# Debian's packages when missing, starts them when stopped, lets root connect over TCP with trust
# auth (a local development machine only). It creates no database: each test makes and drops its
# own, and `make run` (deploy/local/demo.sh) creates the demo's.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PGHOST=127.0.0.1
PGPORT=5432

apt_install() {
  echo "services: installing $*" >&2
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- PostgreSQL ---------------------------------------------------------------------------
if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
  apt_install postgresql postgresql-client
fi
PGVER=$(ls /etc/postgresql | sort -V | tail -n 1)
if ! pg_isready -q -h "$PGHOST" -p "$PGPORT"; then
  echo "services: starting PostgreSQL $PGVER" >&2
  $SUDO pg_ctlcluster --skip-systemctl-redirect "$PGVER" main start || true
  for _ in $(seq 1 60); do pg_isready -q -h "$PGHOST" -p "$PGPORT" && break; sleep 0.5; done
  pg_isready -q -h "$PGHOST" -p "$PGPORT" || { echo "services: PostgreSQL did not start" >&2; exit 1; }
fi
if ! psql -h "$PGHOST" -p "$PGPORT" -U root -d postgres -Atqc 'SELECT 1' >/dev/null 2>&1; then
  # A fresh Debian install: no role `root`, and password auth over TCP. Allow local trust for
  # this development machine, then create the role.
  HBA=/etc/postgresql/$PGVER/main/pg_hba.conf
  if ! $SUDO grep -q '^host all all 127.0.0.1/32 trust' "$HBA"; then
    $SUDO sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$HBA"
    $SUDO pg_ctlcluster --skip-systemctl-redirect "$PGVER" main reload
  fi
  psql -h "$PGHOST" -p "$PGPORT" -U postgres -d postgres -Atqc \
    "DO \$\$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname='root') THEN CREATE ROLE root SUPERUSER LOGIN; END IF; END\$\$;"
fi

# --- Redis --------------------------------------------------------------------------------
if ! command -v redis-server >/dev/null 2>&1; then
  apt_install redis-server redis-tools
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "services: starting Redis" >&2
  $SUDO mkdir -p /var/lib/redis /var/log/redis
  $SUDO redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/cardworker-local.log
  for _ in $(seq 1 40); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.25; done
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null || { echo "services: Redis did not start" >&2; exit 1; }
fi
echo "services: PostgreSQL $PGVER on $PGHOST:$PGPORT and Redis on 127.0.0.1:6379 are up" >&2
