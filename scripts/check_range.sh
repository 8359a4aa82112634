#!/usr/bin/env bash
# The supported range's other end: builds streamer on the oldest Python it declares (3.10, pyenv's
# interpreter on the CI image) with the oldest torch it declares (constraints/oldest.txt), and runs
# the format, load, API and error tests there. The main suite runs on Python 3.11 + torch 2.13.
# The venv ($STREAMER_RANGE_VENV, default outside the clone) is rebuilt only when the constraints
# or the interpreter change; streamer is reinstalled from this checkout every time.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${STREAMER_RANGE_VENV:-$HOME/.cache/streamer-ci/range-venv}"
python="${STREAMER_RANGE_PYTHON:-$(ls -d /root/.pyenv/versions/3.10.*/bin/python3.10 2>/dev/null | tail -1)}"
[ -x "$python" ] || { echo "[range] no Python 3.10 (set STREAMER_RANGE_PYTHON)" >&2; exit 1; }
stamp="$venv/.streamer-range-stamp"
want="$("$python" --version) $(grep -v '^#' constraints/oldest.txt | tr '\n' ' ')"

pip_quiet() { "$venv/bin/python" -m pip "$@" 2>&1 | grep -v '^WARNING: Location' || true; }

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[range] building $venv ($want)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  pip_quiet install -q --upgrade pip
  pip_quiet install -q -c constraints/oldest.txt torch
  echo "$want" >"$stamp"
else
  echo "[range] reusing $venv"
fi
pip_quiet install -q -c constraints/oldest.txt '.[s3]' 'pytest>=8'  # what the tests below import (S3 errors too)
pip_quiet install -q --no-deps ./integrations/vllm  # its metadata is tested (test_packaging.py)
pip_quiet install -q --no-deps ./benchmarks  # the page-cache helpers test_load.py evicts with
(cd / && "$venv/bin/python" -c "import streamer.engine.native as n; n._lib()") \
  || { echo "[range] streamer failed to install" >&2; exit 1; }
"$venv/bin/python" -c 'import sys, torch; print(f"[range] Python {sys.version.split()[0]}, torch {torch.__version__}")'

# The four test_format tests that build tensors of a dtype torch 2.4 lacks (float8_e8m0fnu,
# float4_e2m1fn_x2) are the main suite's; here test_packaging.py checks instead that a file using
# one is a HeaderError naming file and tensor.
"$venv/bin/pytest" -q -p no:cacheprovider \
  tests/test_packaging.py tests/test_format.py tests/test_load.py tests/test_errors.py \
  tests/test_abi.py tests/test_memory_limit.py \
  --deselect tests/test_format.py::test_dtype_table_matches_torch_and_safetensors \
  --deselect tests/test_format.py::test_hand_built_f8_e8m0 \
  --deselect tests/test_format.py::test_hand_built_f4_has_safetensors_torch_shape \
  --deselect tests/test_format.py::test_f4_shapes_torch_cannot_hold \
  "$@"
