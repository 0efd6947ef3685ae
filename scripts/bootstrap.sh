#!/usr/bin/env bash
# One idempotent set-up step for a fresh Debian machine with Python 3.11+:
# system prerequisites (Java 17 for Spark, PostgreSQL server binaries), the
# virtual environment in .venv, the locked Python dependencies, the generated
# protobuf code, and the environment exports that plain `dagster` commands need.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
STAMP="$VENV/.siphon-installed"

say() { printf 'siphon set-up: %s\n' "$*" >&2; }
die() { printf 'siphon set-up: ERROR: %s\n' "$*" >&2; exit 1; }

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || die "no python3 on PATH; install Python 3.11+ (apt-get install python3 python3-venv)"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || die "Python 3.11 or newer is needed, found $("$PYTHON" --version 2>&1)"

apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing $* with apt-get"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; }; then
      die "apt-get could not install $*; install them by hand and run this again"
    fi
  else
    die "missing system packages; run as root: apt-get install $*"
  fi
}

java_major() {
  java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1
}
if ! command -v java >/dev/null || [ "$(java_major)" -lt 17 ] 2>/dev/null; then
  apt_install openjdk-17-jre-headless
fi
command -v java >/dev/null || die "Java 17 is needed by Spark; install openjdk-17-jre-headless"

pg_bindir() {
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    [ -x "$d/initdb" ] && [ -x "$d/postgres" ] && { echo "$d"; return; }
  done
  command -v initdb >/dev/null && command -v postgres >/dev/null && dirname "$(command -v initdb)"
}
if [ -z "$(pg_bindir)" ]; then
  apt_install postgresql postgresql-contrib
fi
[ -n "$(pg_bindir)" ] || die "PostgreSQL server binaries (initdb, postgres) are needed; install postgresql (14+)"
[ -x "$(pg_bindir)/pg_recvlogical" ] || command -v pg_recvlogical >/dev/null \
  || say "pg_recvlogical not found: the producer benchmark needs it (package postgresql-client)"

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment in .venv"
  "$PYTHON" -m venv "$VENV" || die "python3 -m venv failed; install python3-venv"
fi

# Reinstall only when the dependency declarations changed.
wanted=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$wanted" ]; then
  say "installing Python dependencies (locked by constraints.txt)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[dev]"
  echo "$wanted" > "$STAMP"
fi

"$VENV/bin/python" -m siphon_core.wire.generate --quiet
"$VENV/bin/python" -m siphon_core.wire.compiled  # compiles the decoder's loops into their cache

# Plain `dagster ...` from the repo root needs DAGSTER_HOME; the activate script and the Makefile
# both provide it. The code location is found through pyproject.toml's [tool.dagster] block, not
# DAGSTER_MODULE_NAME: `dagster dev` hands its webserver its own code-location arguments, and a
# webserver that also reads that variable stops on a usage error it never prints.
mkdir -p "$ROOT/.dagster_home"
ln -sfn ../dagster.yaml "$ROOT/.dagster_home/dagster.yaml"
cat > "$VENV/bin/siphon-env.sh" <<ENV
# Written by scripts/bootstrap.sh; sourced by .venv/bin/activate.
export DAGSTER_HOME="$ROOT/.dagster_home"
export SIPHON_PG_BINDIR="$(pg_bindir)"
unset DAGSTER_MODULE_NAME
unset -f dagster 2>/dev/null || true
ENV
if ! grep -q 'siphon-env.sh' "$VENV/bin/activate"; then
  printf '\n. "$VIRTUAL_ENV/bin/siphon-env.sh"\n' >> "$VENV/bin/activate"
fi
say "ready (.venv)"
