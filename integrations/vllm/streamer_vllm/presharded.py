"""Pre-sharded checkpoints: each tensor-parallel rank's own files, as vLLM's ``sharded_state``
load format writes them (``ShardedStateLoader.save_model``; Run:ai's ``runai_streamer_sharded``
reads the same layout): ``model-rank-{rank}-part-{part}.safetensors``, or
``model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors`` with pipeline parallelism.

A location whose safetensors all follow one of these names is read this way with
``--load-format streamer``, nothing to set: each rank reads only its own files (no group load:
the ranks' files differ), and their tensors, already in the model's sharded layout, are copied
into its parameters as they are, as ``sharded_state`` does (a LoRA-padded parameter takes the
tensor in its leading part).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from streamer.errors import ConfigError, SourceError

PATTERNS = ("model-rank-*-part-*.safetensors", "model-pp-*-tp-*-part-*.safetensors")


def is_presharded(files: Sequence[str]) -> bool:
    """Whether ``files`` (a checkpoint's paths or URIs) are all a pre-sharded layout's."""
    names = [os.path.basename(path) for path in files]
    return bool(names) and any(
        all(fnmatch.fnmatchcase(name, pattern) for name in names) for pattern in PATTERNS
    )


def rank_files(files: Sequence[str]) -> list[str]:
    """The files of this process's rank, by vLLM's own naming of them; a ``SourceError`` if none."""
    from vllm.model_executor.model_loader import ShardedStateLoader

    pattern = ShardedStateLoader._render_default_pattern(None, part="*")
    mine = sorted(path for path in files if fnmatch.fnmatchcase(os.path.basename(path), pattern))
    if not mine:
        where = os.path.dirname(files[0]) if files else "?"
        raise SourceError(f"a pre-sharded checkpoint with no file for this rank ({pattern})", path=where)
    return mine


def copy_into(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """Copies each ``(name, tensor)`` into the model's parameter or buffer of that name; every one
    of them must be filled, and every tensor must have a place."""
    from vllm.model_executor.model_loader import ShardedStateLoader

    state = ShardedStateLoader._filter_subtensors(model.state_dict())
    for name, tensor in tensors:
        target = state.pop(name, None)
        if target is None:
            raise SourceError(
                "this rank's files hold a tensor the model has no place for", path=where, tensor=name
            )
        data = target.data
        for dim, size in enumerate(tensor.shape):
            if dim < data.dim() and size < data.shape[dim]:
                data = data.narrow(dim, 0, size)
        if data.shape != tensor.shape or data.dtype != tensor.dtype:
            raise ConfigError(
                f"shape/dtype {list(tensor.shape)} {tensor.dtype} does not fit the parameter's "
                f"{list(target.shape)} {target.dtype}",
                path=where,
                tensor=name,
            )
        data.copy_(tensor)
    if state:
        missing = sorted(state)
        raise SourceError(
            f"{len(missing)} parameter(s) of the model are not in this rank's files: "
            + ", ".join(missing[:5])
            + (" ..." if len(missing) > 5 else ""),
            path=where,
        )
