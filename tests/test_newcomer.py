"""What a new user meets: files that are not safetensors said for what they are, messages that
name the right thing, handles that say what they hold, and one way to pass arguments."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_same_dict, write_checkpoint

import streamer
from streamer import HeaderError, MissingFileError
from streamer.config import default_config


def _impostors(directory: Path) -> dict[str, tuple[Path, str]]:
    """(file, what the error must call it) for each common impostor."""
    made: dict[str, tuple[Path, str]] = {}
    zipped = directory / "pytorch_model.bin"
    torch.save({"w": torch.ones(4)}, zipped)
    made["torch.save zip"] = (zipped, "a zip archive, as torch.save writes")
    legacy = directory / "legacy.bin"
    torch.save({"w": torch.ones(4)}, legacy, _use_new_zipfile_serialization=False)
    made["legacy pickle"] = (legacy, "a Python pickle")
    gguf = directory / "model.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(200))
    made["gguf"] = (gguf, "a GGUF file")
    html = directory / "model.safetensors"
    html.write_text("\n<!DOCTYPE html><html><head><title>404 Not Found</title></head></html>\n")
    made["html page"] = (html, "an HTML or XML page")
    lfs = directory / "lfs.safetensors"
    lfs.write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 4939212390\n"
    )
    made["git lfs pointer"] = (lfs, "a Git LFS pointer")
    config = directory / "config.safetensors"
    config.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}')
    made["json"] = (config, "a JSON document")
    return made


def test_files_that_are_not_safetensors_are_named_for_what_they_are(tmp_path: Path) -> None:
    for kind, (path, called) in _impostors(tmp_path).items():
        for call in (streamer.load_file, streamer.open, lambda p: streamer.safe_open(p, "pt")):
            with pytest.raises(HeaderError) as info:
                call(path)
            assert info.value.path == str(path), kind
            assert f"not a safetensors file: this is {called}" in str(info.value), (kind, str(info.value))
            assert "exceeds the limit" not in str(info.value)


def test_a_safetensors_file_with_a_broken_header_is_still_a_plain_header_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(HeaderError, match="exceeds the limit") as info:
        streamer.load_file(path)
    assert "not a safetensors file" not in str(info.value)


def test_missing_paths_say_file_or_directory(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match="no such directory"):
        streamer.load(f"{tmp_path}/checkpoint/")
    with pytest.raises(MissingFileError, match="no such directory"):
        streamer.load(tmp_path / "checkpoint")
    with pytest.raises(MissingFileError, match="no such file or directory"):
        streamer.load(tmp_path / "weights.bin")
    with pytest.raises(MissingFileError, match=r"no such file \("):
        streamer.load(tmp_path / "model.safetensors")
    write_checkpoint(tmp_path / "real", {"a": torch.ones(2)}, index=False)
    assert list(streamer.load(f"{tmp_path}/real/")) == ["a"]


# --- handles -----------------------------------------------------------------------------------


def test_a_closed_handle_refuses_to_read_as_a_closed_safe_open_does(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, {"a": torch.ones(3), "b": torch.zeros(2)}, index=False)
    with streamer.open(written.shards[0]) as handle:
        assert dict(handle)["a"].tolist() == [1, 1, 1]
    for read in (
        lambda: list(handle),
        lambda: handle.get_tensor("a"),
        lambda: handle["a"],
        lambda: handle.read([handle.checkpoint.ref("a")]),
    ):
        with pytest.raises(streamer.FileClosedError) as info:
            read()
        assert isinstance(info.value, ValueError) and info.value.path == str(written.shards[0])
    assert handle.keys() == ["a", "b"] and handle.closed  # what the open learned stays
    opened = streamer.safe_open(written.shards[0], "pt")
    sliced = opened.get_slice("a")
    opened.close()
    with pytest.raises(streamer.FileClosedError):
        opened.get_tensor("a")
    assert sliced[1:].tolist() == [1, 1]  # a slice taken before close still reads, as in safetensors


def test_handles_say_what_they_hold(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, {"a": torch.ones(3), "b": torch.zeros(2, 2)}, shards=2)
    handle = streamer.open(written.directory, "cpu")  # the device positionally, as load takes it
    shown = repr(handle)
    assert shown.startswith("<streamer.Streamer ") and "2 tensors" in shown and "28 bytes" in shown
    assert str(written.shards[0]) in shown and "1 more file" in shown and "device=cpu" in shown
    assert shown.endswith(", open>")
    handle.close()
    assert repr(handle).endswith(", closed>")
    opened = streamer.safe_open(written.shards[1], "pt")
    assert repr(opened).startswith("<streamer.safe_open ") and repr(opened).endswith(", open>")
    assert (
        repr(opened.get_slice("b")) == f"<streamer.TensorSlice 'b' F32 [2, 2] of {str(written.shards[1])!r}>"
    )
    opened.close()
    assert repr(opened).endswith(", closed>")


# --- one parser for every configuration value ---------------------------------------------------


@pytest.mark.parametrize(
    ("field", "given", "expected"),
    [
        ("block_size", "16MiB", 16 << 20),
        ("block_size", 4096, 4096),
        ("concurrency", "4", 4),
        ("concurrency", 4, 4),
        ("memory_limit", 0, "unlimited"),
        ("memory_limit", "0", "unlimited"),
        ("memory_limit", "unlimited", "unlimited"),
        ("memory_limit", "auto", None),
        ("memory_limit", "8GiB", 8 << 30),
        ("hugepages", "yes", True),
        ("hugepages", "0", False),
        ("hugepages", "off", False),
        ("page_fill", "1", True),
        ("io_mode", "Direct", "direct"),
        ("group_timeout", "2.5", 2.5),
        ("group_shm_dir", "none", None),
    ],
)
def test_a_field_takes_the_same_values_from_the_constructor_and_the_environment(
    monkeypatch: pytest.MonkeyPatch, field: str, given: object, expected: object
) -> None:
    assert getattr(streamer.StreamerConfig(**{field: given}), field) == expected
    monkeypatch.setenv(f"STREAMER_{field.upper()}", str(given))
    assert getattr(streamer.StreamerConfig(), field) == expected


@pytest.mark.parametrize(
    ("config", "values", "accepted"),
    [
        (streamer.StreamerConfig, {"block_size": "16 potatoes"}, "a size of at least 1 bytes"),
        (streamer.StreamerConfig, {"block_size": 1.5}, "a size"),
        (streamer.StreamerConfig, {"concurrency": "four"}, "a whole number in 1..1024"),
        (streamer.StreamerConfig, {"concurrency": 2000}, "a whole number in 1..1024"),
        (streamer.StreamerConfig, {"hugepages": "maybe"}, "true or false"),
        (streamer.StreamerConfig, {"memory_limit": -5}, "a size in bytes"),
        (streamer.StreamerConfig, {"memory_limit": False}, "a size in bytes"),
        (streamer.StreamerConfig, {"io_mode": "fast"}, "one of auto, buffered, direct"),
        (streamer.StreamerConfig, {"group_timeout": "soon"}, "a positive number of seconds"),
        (streamer.S3Config, {"concurrency": 0}, "a whole number in 1..1024"),
        (streamer.S3Config, {"min_rate": "fast"}, "a size"),
        (streamer.S3Config, {"anonymous": "perhaps"}, "true or false"),
        (streamer.S3Config, {"load_deadline": -1}, "a positive number of seconds (or None)"),
        (streamer.CacheConfig, {"max_bytes": "0"}, "a size"),
        (streamer.CacheConfig, {"shared_group": "no-such-group-here"}, "a group name or gid"),
    ],
)
def test_a_wrong_value_names_the_field_the_value_and_what_is_accepted(
    config: type, values: dict[str, object], accepted: str
) -> None:
    ((field, value),) = values.items()
    with pytest.raises(streamer.ConfigError) as info:
        config(**values)
    message = str(info.value)
    assert field in message and repr(value) in message and accepted in message, message


def test_a_wrong_environment_value_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMER_S3_MAX_ATTEMPTS", "lots")
    with pytest.raises(streamer.ConfigError, match=r"s3\.max_attempts \(STREAMER_S3_MAX_ATTEMPTS\): 'lots'"):
        streamer.StreamerConfig()


def test_a_call_without_a_config_follows_the_environment_as_it_is_now(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The default config is reused between calls (building one costs ~100 us) only while no
    variable that any config reads was set, changed or unset."""
    path = write_checkpoint(tmp_path, {"w": torch.ones(1000)}, index=False).shards[0]
    monkeypatch.delenv("STREAMER_INLINE_MAX_BYTES", raising=False)
    first = default_config()
    assert default_config() is first  # nothing changed: the same frozen config
    with streamer.open(path) as handle:
        handle.load_all()
        assert handle.config is first and handle.metrics["readers"] == 0  # read inline
    monkeypatch.setenv("STREAMER_INLINE_MAX_BYTES", "0")
    with streamer.open(path) as handle:
        handle.load_all()
        assert handle.config.inline_max_bytes == 0 and handle.metrics["readers"] > 0  # the engine
    monkeypatch.setenv("AWS_REGION", "eu-north-1")  # a sub-config's variable counts as much
    assert default_config().s3.region == "eu-north-1"
    monkeypatch.setenv("STREAMER_S3_MAX_ATTEMPTS", "lots")
    for _ in range(2):  # a wrong value fails every call; nothing is kept from the one before
        with pytest.raises(streamer.ConfigError, match="STREAMER_S3_MAX_ATTEMPTS"):
            streamer.load_file(path)
    monkeypatch.delenv("STREAMER_S3_MAX_ATTEMPTS")
    monkeypatch.delenv("STREAMER_INLINE_MAX_BYTES")
    assert default_config().inline_max_bytes == 64 << 20
    assert_same_dict(streamer.load_file(path), {"w": torch.ones(1000)})


# --- load_into ----------------------------------------------------------------------------------


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


def test_load_into_reports_both_directions_at_once(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {f"x{i}": torch.randn(3, generator=g) for i in range(5)} | {"shared": torch.ones(2)}
    written = write_checkpoint(tmp_path, tensors, index=False)
    dest = {f"y{i}": torch.zeros(3) for i in range(3)} | {"shared": torch.zeros(2)}
    with pytest.raises(streamer.KeyMismatchError) as info:
        streamer.load_into(dest, written.shards[0])
    error = info.value
    assert isinstance(error, streamer.SourceError)
    assert error.missing_keys == ["y0", "y1", "y2"]
    assert error.unexpected_keys == ["x0", "x1", "x2", "x3", "x4"]
    assert "missing from the checkpoint (3): 'y0', 'y1', 'y2'" in str(error)
    assert "not in dest (5): 'x0'" in str(error) and str(written.shards[0]) in str(error)
    assert not dest["shared"].any()  # strict: nothing loaded
    result = streamer.load_into(dest, written.shards[0], strict=False)
    assert result == streamer.IncompatibleKeys(["y0", "y1", "y2"], ["x0", "x1", "x2", "x3", "x4"])
    assert dest["shared"].tolist() == [1, 1]


def test_load_into_takes_a_module_and_fills_its_parameters_and_buffers_in_place(tmp_path: Path) -> None:
    source, target = _Tiny(), _Tiny()
    source.steps.fill_(7)
    written = write_checkpoint(
        tmp_path, {k: v.detach().clone() for k, v in source.state_dict().items()}, index=False
    )
    weight = target.linear.weight
    assert streamer.load_into(target, written.shards[0]) == streamer.IncompatibleKeys([], [])
    assert target.linear.weight is weight and weight.requires_grad
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


@pytest.mark.parametrize("dest", [[torch.zeros(3)], "weights", 5])
def test_load_into_says_what_dest_must_be(tmp_path: Path, dest: object) -> None:
    written = write_checkpoint(tmp_path, {"a": torch.ones(3)}, index=False)
    with pytest.raises(streamer.ConfigError, match=r"a mapping of names to tensors .* or a torch.nn.Module"):
        streamer.load_into(dest, written.shards[0])  # type: ignore[arg-type]


def test_keeping_tensors_from_get_tensor_over_the_memory_limit_warns_as_iterating_does(
    tmp_path: Path,
) -> None:
    tensors = {f"t{i}": torch.ones(1 << 20) for i in range(10)}  # 4 MiB each, 40 MiB in all
    written = write_checkpoint(tmp_path, tensors, index=False)
    config = streamer.StreamerConfig(memory_limit="8MiB")
    for how in ("iterate", "get_tensor"):
        kept = []
        with (
            pytest.warns(RuntimeWarning, match="memory_limit 8388608 exceeded") as caught,
            streamer.open(written.shards[0], config=config) as handle,
        ):
            if how == "iterate":
                kept.extend(tensor for _, tensor in handle)
            else:
                kept.extend(handle.get_tensor(name) for name in list(handle.keys()))
        assert len([w for w in caught if "memory_limit" in str(w.message)]) == 1, how
        assert caught[0].filename == __file__, how  # pointed at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dropping each tensor stays within the limit: no warning
        with streamer.open(written.shards[0], config=config) as handle:
            for name in list(handle.keys()):
                handle.get_tensor(name)


def test_import_leaves_what_a_plain_load_does_not_need() -> None:
    """``import streamer`` is a fixed cost of every load: the ring's machinery (device loads and
    ``load_into``), get_slice's strided reads, the drop-in ``safe_open`` and every cloud SDK wait
    until a load needs them."""
    import json
    import subprocess
    import sys

    later = [
        "streamer.run.staged",
        "streamer.plan.slicing",
        "streamer.run.packed",
        "streamer.group.exchange",
        "streamer.dropin",
    ]
    sdks = ["botocore", "aiobotocore", "aiohttp", "google.auth", "azure.identity", "torch.distributed"]
    code = (
        "import json, sys, torch\n"
        "before = set(sys.modules)\n"
        "import streamer\n"
        f"print(json.dumps(sorted(m for m in {later + sdks!r} if m in sys.modules and m not in before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_drop_in_names_import_like_the_others() -> None:
    """``safe_open`` and ``TensorSlice`` come at first use, yet ``from streamer import ...``,
    ``import *`` and ``dir`` see them as any other name; an unknown name is an AttributeError."""
    import streamer
    from streamer import TensorSlice, dropin, safe_open

    assert safe_open is dropin.safe_open and TensorSlice is dropin.TensorSlice
    assert set(streamer.__all__) <= set(dir(streamer))
    star: dict[str, object] = {}
    exec("from streamer import *", star)
    assert star["safe_open"] is dropin.safe_open
    with pytest.raises(AttributeError, match="no attribute 'safe_opn'"):
        streamer.safe_opn  # noqa: B018
