#!/usr/bin/env bash
# Idempotent set-up on a fresh clone: a local .venv with the pinned set, and redis-server 7.
# Re-running it does nothing once the stamp matches requirements.txt and pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup: Python 3.11 is required (found $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: redis-server not on PATH; installing the OS package"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq redis-server redis-tools >/dev/null
  else
    echo "setup: redis-server (Redis 7) is not on PATH. Install it: 'sudo apt-get install -y redis-server'" >&2
    echo "       (Debian/Ubuntu), 'brew install redis' (macOS), or put a redis-server binary on PATH." >&2
    exit 1
  fi
fi
if ! redis-server --version | grep -q ' v=7\.'; then
  echo "setup: warning: expected Redis 7.x, found: $(redis-server --version)" >&2
fi

stamp=.venv/.installed-$(cat requirements.txt pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
  .venv/bin/pip install -q --disable-pip-version-check --no-deps torchrec==1.8.0
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
