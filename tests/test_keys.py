"""``keys=``: a handle that selects tensors (an expert-parallel rank's experts, a pipeline stage's
layers) reads only their bytes, locally and from S3, and knows no other tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    KiB,
    Written,
    assert_same,
    assert_same_dict,
    checkpoint_order,
    config,
    fd_count,
    loopback_s3_config,
    random_tensor,
    s3_client,
    write_checkpoint,
)

import streamer
from streamer import ConfigError, MissingTensorError

BUCKET = "keys"
CREDENTIALS = ("AKIDKEYSTEST", "keys/secret", "keys-token")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Written:
    """Dense weights and eight experts' weights, as an MoE checkpoint names them, in two shards."""
    g = torch.Generator().manual_seed(38)
    tensors: dict[str, torch.Tensor] = {"embed.weight": random_tensor((64, 96), torch.bfloat16, g)}
    for expert in range(8):
        for part in ("w1", "w2"):
            tensors[f"experts.{expert}.{part}.weight"] = random_tensor((48, 1024 + expert), torch.float32, g)
        tensors[f"experts.{expert}.input_scale"] = random_tensor((), torch.float32, g)
    tensors["norm.weight"] = random_tensor((96,), torch.float16, g)
    return write_checkpoint(tmp_path_factory.mktemp("keys") / "ckpt", tensors, shards=2)


def _local_experts(name: str) -> bool:
    """Dense tensors and experts 0-3: one of two expert-parallel ranks."""
    return not name.startswith("experts.") or int(name.split(".")[1]) < 4


def _wanted(written: Written) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in written.tensors.items() if _local_experts(name)}


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("form", ["test", "names"])
def test_selected_tensors_come_bit_exact_and_no_other_byte_is_read(written: Written, form: str) -> None:
    wanted = _wanted(written)
    keys: Any = _local_experts if form == "test" else set(wanted)
    with streamer.open(written.source, config=config(io_mode="buffered"), keys=keys) as handle:
        assert handle.keys() == [name for name in checkpoint_order(written.shards) if name in wanted]
        assert len(handle) == len(wanted) and "experts.5.w1.weight" not in handle
        assert handle.nbytes == _nbytes(wanted)
        got = {name: tensor for name, tensor in handle}
        read = handle.metrics["bytes_read"]
    assert_same_dict(got, wanted)
    # Reads are rounded out to 4 KiB pages at their ends, and neighbouring tensors coalesce.
    assert _nbytes(wanted) <= read <= _nbytes(wanted) + len(wanted) * 2 * 4 * KiB < written.nbytes


def test_load_takes_keys_and_get_tensor_knows_only_the_selected(written: Written) -> None:
    wanted = _wanted(written)
    assert_same_dict(streamer.load(written.source, config=config(), keys=_local_experts), wanted)
    with streamer.open(written.source, config=config(), keys=_local_experts) as handle:
        assert_same(handle.get_tensor("experts.3.w2.weight"), wanted["experts.3.w2.weight"])
        with pytest.raises(MissingTensorError, match=r"experts\.4\.w1\.weight"):
            handle.get_tensor("experts.4.w1.weight")


def test_a_name_not_in_the_checkpoint_is_named_and_nothing_is_left_open(written: Written) -> None:
    before = fd_count()
    with pytest.raises(MissingTensorError, match=r"experts\.9\.w1\.weight") as raised:
        streamer.open(written.source, config=config(), keys=["embed.weight", "experts.9.w1.weight"])
    assert str(written.shards[0]) in str(raised.value)
    assert fd_count() == before


def test_a_single_string_is_refused_rather_than_read_as_its_letters(written: Written) -> None:
    with pytest.raises(ConfigError, match="keys takes tensor names"):
        streamer.open(written.source, config=config(), keys="embed.weight")


def test_nothing_selected_reads_nothing(written: Written) -> None:
    with streamer.open(written.source, config=config(), keys=lambda name: False) as handle:
        assert handle.keys() == [] and handle.nbytes == 0
        assert list(handle) == []


def test_from_s3_only_the_selected_ranges_are_fetched(
    written: Written, s3_server: str, tmp_path: Path
) -> None:
    client = s3_client(s3_server, CREDENTIALS[0], CREDENTIALS[1])
    client.create_bucket(Bucket=BUCKET)
    for path in [*written.shards, written.index]:
        assert path is not None
        client.upload_file(str(path), BUCKET, f"moe/{path.name}")
    settings = config(s3=loopback_s3_config(s3_server, CREDENTIALS))
    wanted = _wanted(written)
    url = f"s3://{BUCKET}/moe/{written.index.name if written.index else ''}"
    with streamer.open(url, config=settings, keys=_local_experts) as handle:
        got = {name: tensor for name, tensor in handle}
        read = handle.metrics["bytes_read"]
    assert_same_dict(got, wanted)
    assert read < written.nbytes * 0.75, (read, written.nbytes)


def test_a_big_selection_still_streams_under_the_memory_limit(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    tensors = {f"experts.{i}.w.weight": random_tensor((256 * KiB,), torch.uint8, g) for i in range(16)}
    checkpoint = write_checkpoint(tmp_path / "big", tensors)
    limit = 600 * KiB
    with streamer.open(checkpoint.source, config=config(memory_limit=limit), keys=_local_experts) as handle:
        for name, tensor in handle:
            assert_same(tensor, tensors[name], name)
            del tensor
        assert 0 < handle.metrics["peak_buffer_bytes"] <= limit
        assert handle.metrics["tensors"] == 4
