#!/usr/bin/env bash
# The README's main job: set up (idempotent), then `streamtrain up`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/streamtrain" up "$@"
