#!/usr/bin/env bash
# Creates (or reuses) a virtual environment and installs streamer into it with its test extra and
# the bench (benchmarks/, its own distribution). Prints nothing but progress; the venv path is $STREAMER_VENV.
# `setup.sh --bench` installs only what the main job runs (streamer, the bench with its local peers,
# fio): no test tools, cloud SDKs, vLLM plugin or Azure emulator, a minute and a half less.
set -euo pipefail
cd "$(dirname "$0")/.."
bench_only=0
case "${1:-}" in
  --bench) bench_only=1 ;;
  "") ;;
  *) echo "usage: setup.sh [--bench]" >&2; exit 2 ;;
esac

venv="${STREAMER_VENV:-$PWD/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip_quiet() { python -m pip "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
# The package asks for torch>=2.4; constraints/ci.txt pins the CPU build on this machine's disk
# (an unconstrained resolve pulls a multi-GB CUDA build). Before the rename to streamer-weights the
# distribution was called streamer: an old venv's copy is removed so two records do not share files.
pip_quiet uninstall -y -q streamer streamer-vllm | grep -v '^WARNING: Skipping' || true
# The main job times local files only: no cloud SDKs, Run:ai backends or matplotlib (~30 s less).
library='.[test]' bench='./benchmarks[cloud,plot,prometheus]'
[ "$bench_only" = 1 ] && library='.' bench='./benchmarks'
# pip compiles what it installs to bytecode one file at a time (~30 s of a fresh install on 2 cores,
# most of it torch and sympy); compileall does it on every core. Bytecode must exist before the
# bench: its every run is a fresh process, and one with PYTHONDONTWRITEBYTECODE would compile again.
# A dependency's module it cannot compile is left to compile on import, as pip leaves it.
python -m pip install -q --no-compile -c constraints/ci.txt "$library" "$bench" 2>&1 | grep -v '^WARNING: Location' || true
python -m compileall -qq -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
if [ "$bench_only" = 0 ]; then
  # The vLLM plugin (no dependency on vLLM): its vLLM-free parts are tested by the main suite.
  python -m pip install -q --no-deps ./integrations/vllm 2>&1 | grep -v '^WARNING: Location' || true
fi
(cd / && python -c "import streamer.engine.native as n; n._lib()") || { echo "[setup] streamer failed to install" >&2; exit 1; }

# Azurite, the Azure Blob emulator the Azure tests run against (they skip where it is missing).
azurite_dir="${STREAMER_AZURITE:-$HOME/.cache/streamer-ci/azurite}"
if [ "$bench_only" = 0 ] && command -v npm >/dev/null 2>&1 && [ ! -x "$azurite_dir/node_modules/.bin/azurite-blob" ]; then
  mkdir -p "$azurite_dir"
  (cd "$azurite_dir" && npm install --no-audit --no-fund --silent azurite@3.35.0 >/dev/null 2>&1) \
    || echo "[setup] Azurite not installed; the Azure tests will skip"
fi

# fio gives the storage ceiling the benchmark reports beside our figures (optional).
if ! command -v fio >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -qq fio >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq fio >/dev/null 2>&1; }) \
    || echo "[setup] fio not installed; the benchmark falls back to its own read ceiling"
fi
echo "[setup] ready: $venv"
