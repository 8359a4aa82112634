"""Worker of test_format_differential: loads each file with safetensors and with streamer.

Runs as its own process, so that a crash or a hang of either loader costs one case, not the test
run. It imports torch, safetensors and streamer once, then reads one file path per line on stdin
and answers one JSON line on stdout with the facts (who accepted, what was raised, whether the
tensors are the same); the test decides what the facts mean.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open

import streamer
from streamer.config import StreamerConfig

# Small blocks and several threads: the full engine path, tensors cut across blocks.
CONFIG = StreamerConfig(concurrency=3, block_size=64, io_mode="buffered")


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """Row-major bytes for any dtype, 0-d, empty, bool, float8 and float4 included."""
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:300]}"


def compare(theirs: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> str | None:
    """None if both hold the same tensors (names, dtypes, shapes, bytes), else the first difference."""
    if set(theirs) != set(ours):
        return f"names differ: safetensors {sorted(theirs)[:5]}, streamer {sorted(ours)[:5]}"
    for name, expected in theirs.items():
        got = ours[name]
        ours_kind, theirs_kind = (got.dtype, tuple(got.shape)), (expected.dtype, tuple(expected.shape))
        if ours_kind != theirs_kind:
            return f"{name!r}: streamer {ours_kind}, safetensors {theirs_kind}"
        if raw_bytes(got) != raw_bytes(expected):
            return f"{name!r}: bytes differ"
    return None


def examine(path: str) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    theirs: dict[str, torch.Tensor] | None = None
    try:
        theirs = safetensors.torch.load_file(path)
    except Exception as e:  # any refusal counts, even safetensors' own raw TypeError
        facts["theirs"] = describe(e)
    ours: dict[str, torch.Tensor] | None = None
    try:
        ours = streamer.load_file(path, config=CONFIG)
    except streamer.StreamerError as e:
        facts["ours"] = describe(e)
        facts["ours_class"] = type(e).__name__
        facts["ours_path"] = e.path
    except Exception as e:
        facts["ours"] = describe(e)
        facts["ours_class"] = type(e).__name__
        facts["raw_exception"] = True
    if theirs is not None and ours is not None:
        facts["difference"] = compare(theirs, ours) or compare_metadata(path)
        facts["tensors"] = len(theirs)
    return facts


def compare_metadata(path: str) -> str | None:
    with safe_open(path, framework="pt") as f:
        theirs = f.metadata() or {}
    with streamer.open(path, config=CONFIG) as s:
        ours = s.metadata()
    return None if ours == theirs else f"metadata differs: streamer {ours}, safetensors {theirs}"


def main() -> None:
    for line in sys.stdin:
        facts = examine(line.rstrip("\n"))
        sys.stdout.write(json.dumps(facts) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
