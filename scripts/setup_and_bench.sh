#!/usr/bin/env bash
# The main job: install streamer (and the peers it is compared with), then time cold and warm
# loads of a generated Llama-like checkpoint against every installed peer. Extra arguments go
# to streamer-bench, e.g. `--synthetic 4GiB --repeat 5 --json result.json --plot result.png`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --bench
# shellcheck disable=SC1091
. "${STREAMER_VENV:-$PWD/.venv}/bin/activate"
cd /  # run the installed package, not the checkout
exec streamer-bench "$@"
