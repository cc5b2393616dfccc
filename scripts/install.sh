#!/usr/bin/env bash
# Install kohakumoss with the torch build of this machine's NVIDIA driver (scripts/install.py):
#   bash scripts/install.sh            # or --dry-run, --cpu, --eightbit
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
exec "$PY" scripts/install.py "$@"
