#!/usr/bin/env bash
# The README's test command: set up (idempotent) what the main job needs (scripts/setup.sh) and what
# only the tests use (scripts/setup_tests.sh), then run the whole test suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
bash "$root/scripts/setup_tests.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
