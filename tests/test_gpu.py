"""The staged path on a real GPU: exactness, ``load_into``, stream ordering, host memory bounds.

Skipped without CUDA (CI); tests/test_staged.py covers the same machinery on CPU with a
stand-in copy engine. Run on a GPU machine with ``pytest tests/test_gpu.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    TORCH_DTYPE,
    KiB,
    MiB,
    Written,
    assert_same,
    checkpoint_order,
    random_tensor,
    reference_load,
    write_checkpoint,
)

import streamer
from streamer import StreamerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda:0"


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory: pytest.TempPathFactory) -> Written:
    g = torch.Generator().manual_seed(41)
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, dtype) in enumerate(TORCH_DTYPE.items()):
        tensors[f"{name}.big"] = random_tensor((300 * KiB + i,), dtype, g)
        tensors[f"{name}.small"] = random_tensor((7, 3 + i), dtype, g)
        tensors[f"{name}.scalar"] = random_tensor((), dtype, g)
    tensors["empty"] = torch.empty(0, 4)
    return write_checkpoint(tmp_path_factory.mktemp("gpu"), tensors, shards=2)


def assert_on_gpu(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert tensor.device.type == "cuda", name
        assert_same(tensor.cpu(), expected[name], name)


@pytest.mark.parametrize("memory_limit", [None, 256 * KiB])
def test_load_to_gpu_is_bit_exact_for_every_dtype(every_dtype: Written, memory_limit: int | None) -> None:
    config = StreamerConfig(memory_limit=memory_limit)
    got = streamer.load(every_dtype.index, DEVICE, config=config)
    assert list(got) == checkpoint_order(every_dtype.shards)
    assert_on_gpu(got, reference_load(every_dtype.shards))


def test_streaming_on_a_side_stream_sees_complete_tensors(every_dtype: Written) -> None:
    """The consumer's current stream is ordered after each tensor's copy: no synchronize needed."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), streamer.open(every_dtype.index, device=DEVICE) as s:
        copies = {name: t.clone() for name, t in s}  # runs on ``side``
        metrics = s.metrics
    torch.cuda.current_stream().wait_stream(side)
    assert_on_gpu(copies, every_dtype.tensors)
    assert metrics["ring_alloc_s"] > 0 and metrics["copies"] > 0


def test_load_into_gpu_tensors(every_dtype: Written) -> None:
    dest = {name: torch.zeros_like(t, device=DEVICE) for name, t in every_dtype.tensors.items()}
    dest["F32.small"] = torch.nn.Parameter(dest["F32.small"])
    shape = every_dtype.tensors["I64.small"].shape
    dest["I64.small"] = torch.zeros(
        shape[1], shape[0], dtype=torch.int64, device=DEVICE
    ).t()  # non-contiguous
    pointers = {name: t.data_ptr() for name, t in dest.items()}
    streamer.load_into(dest, every_dtype.index)
    assert {name: t.data_ptr() for name, t in dest.items()} == pointers
    assert_on_gpu({n: t.detach() for n, t in dest.items()}, every_dtype.tensors)


_CHILD = r"""
import gc, json, sys
import torch
import streamer

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

args = json.loads(sys.argv[1])
config = streamer.StreamerConfig(memory_limit=args["limit"])
torch.ones(1, device="cuda:0").sum()
streamer.load(args["warmup"], "cuda:0", config=config)  # CUDA context, kernels, reader threads
gc.collect()
torch.cuda.synchronize()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
baseline = status("VmRSS")
after = []
for _ in range(args["repeat"]):
    loaded = streamer.load(args["source"], "cuda:0", config=config)
    nbytes = sum(t.numel() * t.element_size() for t in loaded.values())
    del loaded
    gc.collect()
    torch.cuda.empty_cache()
    after.append(status("VmRSS"))
print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "after": after, "bytes": nbytes}))
"""


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> tuple[Written, Written]:
    """2 GiB of 32 MiB tensors (far more than the 128 MiB ring below) and a tiny warm-up file."""
    g = torch.Generator().manual_seed(42)
    base = torch.randint(0, 256, (32 * MiB,), dtype=torch.uint8, generator=g)
    tensors = {f"layer.{i:02d}": (base + i).view(torch.bfloat16) for i in range(64)}
    directory = tmp_path_factory.mktemp("large")
    written = write_checkpoint(directory / "big", tensors, shards=4)
    warmup = write_checkpoint(directory / "warm", {"w": random_tensor((KiB,), torch.float32, g)}, index=False)
    return written, warmup


def _run_child(large: tuple[Written, Written], limit: int, repeat: int) -> dict[str, Any]:
    written, warmup = large
    args = {"source": str(written.index), "warmup": str(warmup.source), "limit": limit, "repeat": repeat}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=Path(written.directory),
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_host_rss_stays_under_the_limit_while_loading_to_gpu(large: tuple[Written, Written]) -> None:
    limit = 128 * MiB
    result = _run_child(large, limit, repeat=1)
    growth = result["peak"] - result["baseline"]
    assert result["bytes"] == large[0].nbytes
    assert growth <= limit + 256 * MiB, (
        f"host RSS grew by {growth / MiB:.0f} MiB for a {limit / MiB:.0f} MiB limit"
    )


def test_repeated_loads_do_not_leak_pinned_memory(large: tuple[Written, Written]) -> None:
    """Each load pins its ring once; a second to fifth load must not grow the process."""
    result = _run_child(large, 128 * MiB, repeat=5)
    first, last = result["after"][0], result["after"][-1]
    assert last - first <= 32 * MiB, f"RSS after each load (MiB): {[a // MiB for a in result['after']]}"
