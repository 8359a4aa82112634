"""The loader honours a model's ``secondary_weights`` and ``is_unused_checkpoint_weight`` as vLLM's
default loader does: same tensors, same names, and shards the model never loads are not read.

The loader is driven directly with a stand-in model (no engine): what these hooks change is
which checkpoints are read and what reaches ``model.load_weights``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the vLLM venv (scripts/setup_vllm.sh)")
pytest.importorskip("streamer_vllm", reason="needs the plugin installed (scripts/setup_vllm.sh)")

import safetensors.torch
import torch
from torch import nn
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

import streamer_vllm
from streamer_vllm.loader import StreamerModelLoader


def _tensors(seed: int, names: list[str]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(16, 8, generator=generator) for name in names}


class StandIn(nn.Module):
    """Records every ``(name, tensor)`` it is given; its one parameter is reported loaded."""

    def __init__(self, secondary: list[Any], unused_prefix: str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.secondary_weights = secondary
        self.seen: dict[str, torch.Tensor] = {}
        if unused_prefix is not None:
            prefix = unused_prefix
            self.is_unused_checkpoint_weight = lambda name: name.startswith(prefix)

    def load_weights(self, weights: Any) -> set[str]:
        for name, tensor in weights:
            self.seen[name] = tensor.clone()
        return {"weight"}


def _load(model: StandIn, model_dir: Path) -> list[str]:
    streamer_vllm.register()
    loader = StreamerModelLoader(LoadConfig(load_format="streamer"))
    config = SimpleNamespace(
        model=str(model_dir), model_weights="", revision=None, quantization=None, is_moe=False
    )
    loader.load_weights(model, config)  # type: ignore[arg-type]
    return list(model.seen)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    safetensors.torch.save_file(_tensors(0, ["a.weight", "b.weight"]), str(directory / "model.safetensors"))
    return directory


def test_secondary_sources_load_under_their_prefix(model_dir: Path, tmp_path: Path) -> None:
    """A safetensors tower in a subfolder is streamed; a ``.pt`` head goes to vLLM's loader."""
    tower = tmp_path / "tower"
    (tower / "sub").mkdir(parents=True)
    tower_tensors = _tensors(1, ["x.weight", "y.bias"])
    safetensors.torch.save_file(tower_tensors, str(tower / "sub" / "model.safetensors"))
    head_tensors = _tensors(2, ["proj.weight"])
    torch.save(head_tensors, model_dir / "head.pt")
    model = StandIn(
        [
            DefaultModelLoader.Source(str(tower), None, subfolder="sub", prefix="tower."),
            DefaultModelLoader.Source(
                str(model_dir), None, prefix="head.", allow_patterns_overrides=["head.pt"]
            ),
        ]
    )
    names = _load(model, model_dir)
    assert names[:2] == ["a.weight", "b.weight"]  # the model's own checkpoint first, then the others
    expected = {
        **_tensors(0, ["a.weight", "b.weight"]),
        **{f"tower.{k}": v for k, v in tower_tensors.items()},
        **{f"head.{k}": v for k, v in head_tensors.items()},
    }
    assert sorted(names) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(model.seen[name], tensor), name


def test_shards_holding_only_unused_weights_are_not_read(tmp_path: Path) -> None:
    directory = tmp_path / "sharded"
    directory.mkdir()
    used = _tensors(3, ["model.layers.0.weight"])
    unused = _tensors(4, ["mtp.0.weight", "mtp.1.weight"])
    safetensors.torch.save_file(used, str(directory / "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file(unused, str(directory / "model-00002-of-00002.safetensors"))
    model = StandIn([], unused_prefix="mtp.")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    plugin_logger = logging.getLogger("vllm.plugins.streamer")
    level = plugin_logger.level
    plugin_logger.addHandler(handler)
    plugin_logger.setLevel(logging.INFO)
    try:
        assert _load(model, directory) == ["model.layers.0.weight"]
    finally:
        plugin_logger.removeHandler(handler)
        plugin_logger.setLevel(level)
    assert torch.equal(model.seen["model.layers.0.weight"], used["model.layers.0.weight"])
    (line,) = [line for line in lines if line.startswith("Loading weights took")]  # what was read, once
    unused_bytes = sum(t.nbytes for t in unused.values())
    assert f"1 shard(s) of weights the model never loads skipped ({unused_bytes} bytes)" in line


def test_every_shard_unused_reads_them_all_as_vllm_does(model_dir: Path) -> None:
    model = StandIn([], unused_prefix="")  # every name is "unused": vLLM then keeps every shard
    assert sorted(_load(model, model_dir)) == ["a.weight", "b.weight"]
