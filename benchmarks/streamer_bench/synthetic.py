"""A Llama-like bf16 checkpoint of a requested size, sharded the way Hugging Face does it.

Tensor names and shapes follow ``LlamaForCausalLM`` (``model.embed_tokens``, per-layer
``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, two RMS norms, ``model.norm``,
``lm_head``). The architecture is chosen from real Llama sizes so that embeddings stay a small
share of the bytes; the vocabulary then absorbs the remainder so the total lands on the
requested size. Values are bf16 draws from N(0, 0.02) (norms are ones), cut from one random
block that is generated once and reused, so writing 4 GiB costs what the disk costs.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

GENERATOR_VERSION = 1
MARKER = "streamer-bench-checkpoint.json"
INDEX = "model.safetensors.index.json"
BF16 = 2  # bytes per element
_RANDOM_BLOCK_ELEMENTS = 16 << 20  # 32 MiB of bf16, reused with a rotating start
_WRITE_CHUNK = 16 << 20

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions that decide every tensor's shape."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def layer_elements(self) -> int:
        h = self.hidden
        return 2 * h * h + 2 * self.kv_dim * h + 3 * h * self.intermediate + 2 * h


# (hidden, intermediate, heads, kv_heads, vocab) of real Llama-family models, largest first.
_PRESETS: tuple[tuple[int, int, int, int, int], ...] = (
    (8192, 28672, 64, 8, 128256),  # Llama-3-70B
    (5120, 13824, 40, 40, 32000),  # Llama-2-13B
    (4096, 14336, 32, 8, 128256),  # Llama-3-8B
    (4096, 11008, 32, 32, 32000),  # Llama-2-7B
    (3072, 8192, 24, 8, 128256),  # Llama-3.2-3B
    (2048, 5632, 32, 4, 32000),  # TinyLlama-1.1B
    (1024, 2816, 16, 4, 32000),
    (512, 1408, 8, 2, 32000),
    (256, 704, 4, 2, 8192),
    (128, 352, 4, 2, 4096),
    (64, 176, 4, 2, 1024),
)
_MIN_LAYERS = 8
_MAX_EMBEDDING_SHARE = 0.25


def choose_shape(total_bytes: int) -> LlamaShape:
    """The largest preset whose embeddings stay under a quarter and that fits 8 layers."""
    for hidden, inter, heads, kv_heads, vocab in _PRESETS:
        shape = LlamaShape(hidden, inter, heads, kv_heads, vocab, layers=1)
        fixed = (2 * vocab * hidden + hidden) * BF16
        layer = shape.layer_elements() * BF16
        if fixed <= total_bytes * _MAX_EMBEDDING_SHARE and fixed + _MIN_LAYERS * layer <= total_bytes:
            break
    layers = max(1, (total_bytes - fixed) // layer)
    # The vocabulary (embed_tokens and lm_head) absorbs what whole layers leave over.
    spare = total_bytes - layers * layer - hidden * BF16
    vocab = max(vocab, spare // (2 * hidden * BF16) // 64 * 64)
    return LlamaShape(hidden, inter, heads, kv_heads, vocab, int(layers))


def tensor_shapes(shape: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the model, in ``state_dict`` order."""
    h, kv, inter = shape.hidden, shape.kv_dim, shape.intermediate
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        tensors += [
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.mlp.down_proj.weight", (h, inter)),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    tensors += [("model.norm.weight", (h,)), ("lm_head.weight", (shape.vocab, h))]
    return tensors


def _nbytes(dims: tuple[int, ...]) -> int:
    return int(np.prod(dims, dtype=np.int64)) * BF16


def split_shards(
    tensors: list[tuple[str, tuple[int, ...]]], shards: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive runs of tensors with about equal bytes (``save_pretrained`` keeps order)."""
    total = sum(_nbytes(d) for _, d in tensors)
    out: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(shards)]
    done = 0
    for name, dims in tensors:
        index = min(shards - 1, done * shards // total)
        out[index].append((name, dims))
        done += _nbytes(dims)
    return [shard for shard in out if shard]


def _header(tensors: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """A safetensors header: tensors sorted by name (as safetensors writes them), 8-byte padded."""
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in sorted(tensors):
        size = _nbytes(dims)
        meta[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class _RandomBytes:
    """Writes pseudo-random bf16 bytes cut from one pre-generated block."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        values = rng.standard_normal(_RANDOM_BLOCK_ELEMENTS, dtype=np.float32) * np.float32(0.02)
        bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
        block = bf16.tobytes()
        self._block = memoryview(block + block[:_WRITE_CHUNK])  # a window never wraps
        self._ones = memoryview(np.full(_WRITE_CHUNK // BF16, 0x3F80, dtype=np.uint16).tobytes())
        self._cursor = 0

    def write(self, fh: BinaryIO, nbytes: int, ones: bool, report: Callable[[int], None]) -> None:
        write = fh.write
        block_len = len(self._block) - _WRITE_CHUNK
        while nbytes > 0:
            n = min(nbytes, _WRITE_CHUNK)
            if ones:
                write(self._ones[:n])
            else:
                write(self._block[self._cursor : self._cursor + n])
                self._cursor = (self._cursor + 7919 * BF16 + n) % block_len // BF16 * BF16
            nbytes -= n
            report(n)


@dataclass(frozen=True)
class Synthetic:
    """A generated checkpoint: its directory, index, shard files and shape."""

    directory: Path
    index: Path
    files: list[Path]
    shape: LlamaShape
    tensor_bytes: int
    reused: bool


def _marker(size: int, shards: int) -> dict[str, int]:
    return {"generator": GENERATOR_VERSION, "size": size, "shards": shards}


def _reuse(directory: Path, size: int, shards: int) -> Synthetic | None:
    """The checkpoint already in ``directory`` when it was generated with the same request."""
    try:
        marker = json.loads((directory / MARKER).read_text())
        if {k: marker.get(k) for k in ("generator", "size", "shards")} != _marker(size, shards):
            return None
        files = [directory / name for name in marker["files"]]
        if any(f.stat().st_size != s for f, s in zip(files, marker["file_sizes"], strict=True)):
            return None
        return Synthetic(
            directory, directory / INDEX, files, LlamaShape(**marker["shape"]), marker["tensor_bytes"], True
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def generate(
    directory: Path, size: int, shards: int = 2, *, seed: int = 0, progress: Progress | None = None
) -> Synthetic:
    """Writes (or reuses) a ``size``-byte Llama-like checkpoint in ``shards`` files under ``directory``."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    directory.mkdir(parents=True, exist_ok=True)
    existing = _reuse(directory, size, shards)
    if existing is not None:
        return existing
    (directory / MARKER).unlink(missing_ok=True)
    shape = choose_shape(size)
    groups = split_shards(tensor_shapes(shape), shards)
    total = sum(_nbytes(d) for group in groups for _, d in group)
    source = _RandomBytes(seed)
    written = 0

    def report(n: int) -> None:
        nonlocal written
        written += n
        if progress is not None:
            progress(written, total)

    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        path = directory / f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        with open(path, "wb") as fh:
            fh.write(_header(group))
            for name, dims in sorted(group):
                source.write(fh, _nbytes(dims), name.endswith("norm.weight"), report)
            fh.flush()
            os.fsync(fh.fileno())  # no writeback left to disturb the timed runs
        files.append(path)
        weight_map.update({name: path.name for name, _ in group})
    index = directory / INDEX
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    marker = _marker(size, shards) | {
        "files": [f.name for f in files],
        "file_sizes": [f.stat().st_size for f in files],
        "shape": shape.__dict__,
        "tensor_bytes": total,
    }
    (directory / MARKER).write_text(json.dumps(marker, indent=2))
    return Synthetic(directory, index, files, shape, total, False)
