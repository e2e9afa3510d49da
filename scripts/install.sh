#!/usr/bin/env bash
# Set up streamrl from nothing: Debian's redis-server (tests and the Redis sandbox need it), a venv,
# and the pinned Python packages. CPU torch 2.13.0 comes from the local wheel folder in
# $PIP_FIND_LINKS (uv ignores pip's configuration, so the folder is passed explicitly).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else
        echo "redis-server is missing: install Debian's redis-server package (tests that need it will fail)" >&2
    fi
fi

PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q uv==0.13.8
UV_COMPILE_BYTECODE=1 .venv/bin/uv pip install -q --python .venv/bin/python \
    --find-links "${PIP_FIND_LINKS:-/opt/wheels}" -e ".[dev,ray]"
echo "installed: $(.venv/bin/python -c 'import torch, streamrl; print("torch", torch.__version__)')"
