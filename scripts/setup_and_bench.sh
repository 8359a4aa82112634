#!/usr/bin/env bash
# The main job: install streamer (and the peers it is compared with), then time cold and warm
# loads of a generated Llama-like checkpoint against every installed peer. Extra arguments go
# to streamer-bench, e.g. `--synthetic 4GiB --repeat 5 --json result.json --plot result.png`.
# The whole job aims at 6 minutes: the bench gets --time-budget what the install left of them,
# less 10 s for its own start-up and report (60 s at least), so a noisy disk ends a state after
# fewer rounds, its undecided verdict saying so, instead of running 10. `--time-budget none`
# (or another figure) overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."
JOB_SECONDS=360
bash scripts/setup.sh --bench
# shellcheck disable=SC1091
. "${STREAMER_VENV:-$PWD/.venv}/bin/activate"
cd /  # run the installed package, not the checkout
if [ "${1:-}" = vllm ]; then  # the vLLM cold-start subcommand has its own arguments
    exec streamer-bench "$@"
fi
budget=$((JOB_SECONDS - 10 - SECONDS))
exec streamer-bench --time-budget "$((budget > 60 ? budget : 60))" "$@"
