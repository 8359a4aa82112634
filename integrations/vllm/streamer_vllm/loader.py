"""vLLM's ``BaseModelLoader`` for ``--load-format streamer``.

Imported only by :func:`streamer_vllm.register`, i.e. once vLLM itself is running: this is the
one module of the plugin that imports vLLM.

Tensors go to ``model.load_weights`` exactly as streamer yields them, without a defensive copy:
on the CPU each one is a view into a buffer that streamer never reuses while any view into it
is alive, so a tensor vLLM keeps (or copies late) cannot change under it; on a GPU each one
is a view into device memory of its own, handed out once the current stream is ordered after
its copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Collection, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.weight_utils import enable_tqdm

import streamer
from streamer.api import source_files
from streamer.backends.sources import SourceLike
from streamer.observe.progress import ByteProgress
from streamer_vllm import presharded
from streamer_vllm.affinity import on_parent_cpus
from streamer_vllm.checks import check_all_loaded, target_device
from streamer_vllm.distributed import loading_group, tensor_parallel_size
from streamer_vllm.experts import NameFilter, local_experts_only
from streamer_vllm.hub import fetch_from_hub
from streamer_vllm.load_settings import check_load_config
from streamer_vllm.options import LoaderOptions, is_remote, parse_options, weights_source
from streamer_vllm.prefault import parameters_faulted_in
from streamer_vllm.secondary import StreamedSource, delegated_weights, files_in_use, secondary_sources
from streamer_vllm.slices import Index, probe_slices

Metrics = list[tuple[str, dict[str, Any]]]  # per checkpoint read: where from, streamer's metrics

# Under ``vllm.`` so that vLLM's own logging configuration (handler, format, level) applies.
logger = logging.getLogger("vllm.plugins.streamer")

# Where each model of this process was first loaded from: a reload (a fresh loader each time)
# whose model config points elsewhere was given a ``weights_path``.
_first_location: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


class StreamerModelLoader(BaseModelLoader):  # type: ignore[misc]  # vLLM ships no type information
    """Streams every tensor of the safetensors checkpoint into the model as soon as it is read."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        if not isinstance(extra, dict):
            raise ValueError(
                "load format 'streamer' takes a dict as model_loader_extra_config, "
                f"got {type(extra).__name__}"
            )
        self.options: LoaderOptions = parse_options(extra)
        defaults = LoadConfig()
        fields = [f.name for f in dataclasses.fields(load_config)]
        unknown = check_load_config(
            {name: getattr(load_config, name) for name in fields},
            {name: getattr(defaults, name) for name in fields},
        )
        if unknown:
            fields_text = ", ".join(unknown)
            logger.warning("load format 'streamer' does not act on LoadConfig field(s): %s", fields_text)

    def _source(self, model_config: ModelConfig, model: nn.Module | None = None) -> SourceLike:
        """What streamer reads: ``weights``, else the model's directory or S3 URI, else the model id
        fetched from the Hugging Face hub (or its cache) as the default loader fetches it. A
        reload from elsewhere (``weights_path``) reads where the model config now points: the
        ``weights`` option named the first load's files."""
        location = getattr(model_config, "model_weights", "") or model_config.model
        options = self.options
        if model is not None and _first_location.get(model, model_config.model) != model_config.model:
            options = dataclasses.replace(options, weights=None)
        local = os.path.exists(os.path.expanduser(location))
        if options.weights is not None or is_remote(location) or local:
            return weights_source(options, location)
        overrides = getattr(model, "allow_patterns_overrides", None)
        fetched = fetch_from_hub(location, model_config.revision, self.load_config, overrides)
        return fetched if isinstance(fetched, list) else weights_source(options, fetched)

    def download_model(self, model_config: ModelConfig) -> None:
        """Downloads a model id's safetensors; checks that local weights are where they are said to be."""
        source = self._source(model_config)
        if not (isinstance(source, str) and is_remote(source)):
            streamer.open(source).close()  # resolves the files and parses every header

    def iterate_weights(
        self,
        source: StreamedSource,
        device: str,
        metrics: Metrics,
        wanted: NameFilter | None = None,
        slices: Mapping[str, Index] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of ``source`` that ``wanted`` passes, as it completes, uncopied; ``metrics``
        gets streamer's once all were read. Shards holding only weights the model never loads,
        and tensors ``wanted`` fails (another expert-parallel rank's), are not read. The tensors
        of ``slices`` come last, only their slice read (``slices.py``)."""
        handle, skipped = self._open(source, device, wanted, slices or {})
        with handle, contextlib.ExitStack() as stack:
            show = enable_tqdm(self.load_config.use_tqdm_on_load)
            bar: ByteProgress | None = None
            for name, tensor in handle:
                if bar is None:  # made at the first tensor: asking ``nbytes`` sooner would wait for S3
                    # to confirm a provisional open (a node cache's note) instead of reading meanwhile
                    desc = "Loading safetensors using streamer"
                    bar = stack.enter_context(ByteProgress(handle.nbytes, desc=desc, enabled=show))
                bar.update(tensor.nbytes)
                yield source.prefix + name, tensor
                del tensor  # vLLM's reference alone decides when its buffer is free
        metrics.append((str(source.source), {**handle.metrics, **skipped}))
        if slices:
            yield from self._sliced(source, device, slices, metrics)

    def _sliced(
        self, source: StreamedSource, device: str, slices: Mapping[str, Index], metrics: Metrics
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor of ``slices`` at its full shape, only the slice read and filled: the part
        the model's loader was seen to copy (the rest is never looked at)."""
        loaded = read = unread = 0
        with streamer.safe_open(source.source, device=device, config=self.options.config) as opened:
            for name, index in slices.items():
                whole = opened.get_slice(name)
                part = whole[index]
                read += int(opened.handle.metrics.get("bytes_read", 0))
                tensor = torch.empty(whole.get_shape(), dtype=part.dtype, device=part.device)
                tensor[index] = part
                loaded += part.nbytes
                unread += tensor.nbytes - part.nbytes
                yield source.prefix + name, tensor
                del tensor, part
        sliced = {"sliced_tensors": len(slices), "sliced_unread_bytes": unread}
        metrics.append((str(source.source), {"bytes": loaded, "bytes_read": read, **sliced}))

    def _open(
        self, source: StreamedSource, device: str, wanted: NameFilter | None, sliced: Collection[str]
    ) -> tuple[streamer.Streamer, dict[str, int]]:
        """``source`` opened with only the tensors ``wanted`` passes and not ``sliced``, less the
        shards holding only weights the model never loads; what was left out: shards and tensors
        (other ranks' experts), and their bytes."""
        group = loading_group(self.options.distributed and source.shared, device)
        settings = self.options.config
        keys = (
            wanted if not sliced else (lambda name: name not in sliced and (wanted is None or wanted(name)))
        )
        handle = streamer.open(source.source, device=device, config=settings, group=group, keys=keys)
        if wanted is None and source.is_unused is None:
            return handle, {}  # not asking for the checkpoint: a provisional open reads meanwhile
        try:
            headers = handle.checkpoint.headers
            selected = set(handle.keys())
            others = [t for h in headers for t in h.tensors if wanted is not None and not wanted(t.name)]
            skipped = {"skipped_tensors": len(others), "skipped_tensor_bytes": sum(t.nbytes for t in others)}
            kept = None if source.is_unused is None else files_in_use(handle.checkpoint, source.is_unused)
        except BaseException:
            handle.close()
            raise
        if kept is None:
            return handle, skipped
        left_out = [h for h in headers if h.path not in kept]
        skipped["skipped_shards"] = len(left_out)
        skipped["skipped_bytes"] = sum(t.nbytes for h in left_out for t in h.tensors if t.name in selected)
        handle.close()
        kept_handle = streamer.open(kept, device=device, config=settings, group=group, keys=keys)
        return kept_handle, skipped

    def all_weights(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        device: str,
        metrics: Metrics,
        slices: Mapping[str, Index] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's checkpoint, then its ``secondary_weights``, as the default loader orders them;
        under expert parallelism, without the other ranks' experts (``experts.py``); of the
        checkpoint's tensors in ``slices``, only their slice."""
        primary = StreamedSource(
            self._source(model_config, model), is_unused=getattr(model, "is_unused_checkpoint_weight", None)
        )
        wanted = self._wanted(model_config)
        yield from self.iterate_weights(primary, device, metrics, wanted, slices)
        for extra in secondary_sources(model, self.load_config):
            if isinstance(extra, StreamedSource):
                yield from self.iterate_weights(extra, device, metrics, wanted)
            else:
                logger.info("Secondary weights %r: not safetensors, vLLM's loader reads them", extra.source)
                yield from delegated_weights(extra)

    def _tensor_parallel_slices(
        self, model: nn.Module, model_config: ModelConfig, device: str
    ) -> dict[str, Index] | None:
        """What this rank keeps of each checkpoint tensor (``slices.py``), when it is a tensor-
        parallel rank loading without a group and the model is not quantized (quantization methods
        make parameters of their own; those load whole)."""
        if model_config.quantization is not None or tensor_parallel_size() < 2:
            return None
        if loading_group(self.options.distributed, device) is not None:
            return None
        source = self._source(model_config, model)
        with streamer.open(source, config=self.options.config, keys=self._wanted(model_config)) as handle:
            shapes = {
                name: (tuple(ref.entry.shape), ref.entry.dtype.torch_dtype)
                for name, ref in handle.checkpoint.tensors.items()
                if ref.entry.dtype.per_item == 1  # packed dtypes (F4) load whole
            }
        return probe_slices(model, shapes) or None

    def _wanted(self, model_config: ModelConfig) -> NameFilter | None:
        """The test a checkpoint name passes when this rank reads it (``experts.py``), if any."""
        return local_experts_only(model_config) if self.options.ep_weight_filter else None

    def get_all_weights(
        self, model_config: ModelConfig, model: nn.Module
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Every tensor, streamed as at the first load: what vLLM's in-place reload reads
        (``collective_rpc("reload_weights", ...)``, as RL loops do every few minutes), from the
        model's location or the ``weights_path`` the reload gave (local, ``s3://``, a hub id)."""
        device = target_device(model)
        metrics: Metrics = []
        started = time.perf_counter()
        with self._cpus(device) as cpus:
            yield from self.all_weights(model, model_config, device, metrics)
        self._log("Reading weights for a reload took", time.perf_counter() - started, device, metrics, cpus)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        device = target_device(model)
        metrics: Metrics = []
        started = time.perf_counter()
        own = self._rank_files(model_config, model)
        with self._cpus(device) as cpus, self._prefaulted(model, device):
            if own is not None:  # already in the model's layout: copied into its parameters as they are
                tensors = self.iterate_weights(StreamedSource(own, shared=False), device, metrics)
                presharded.copy_into(model, tensors, os.path.dirname(own[0]))
            else:
                # vLLM models define load_weights(Iterable[(name, tensor)]) -> the loaded parameter names
                slices = self._tensor_parallel_slices(model, model_config, device)
                weights = self.all_weights(model, model_config, device, metrics, slices)
                loaded = cast(Any, model).load_weights(weights)
        _first_location.setdefault(model, model_config.model)
        self._log("Loading weights took", time.perf_counter() - started, device, metrics, cpus)
        if own is None:
            check_all_loaded(model, loaded, quantized=model_config.quantization is not None)

    def _cpus(self, device: str) -> contextlib.AbstractContextManager[set[int] | None]:
        """A CPU load's threads on the parent's CPUs (``affinity.py``), unless ``parent_cpus`` is off."""
        return on_parent_cpus() if device == "cpu" and self.options.parent_cpus else contextlib.nullcontext()

    def _prefaulted(self, model: nn.Module, device: str) -> contextlib.AbstractContextManager[None]:
        """A CPU load's parameters faulted in beside it (``prefault.py``), unless ``prefault`` is off."""
        if device == "cpu" and self.options.prefault:
            return parameters_faulted_in(model)
        return contextlib.nullcontext()

    def _rank_files(self, model_config: ModelConfig, model: nn.Module) -> list[str] | None:
        """This rank's files, when the weights are a pre-sharded checkpoint (``presharded``): a
        local directory of such files is one; a remote one when ``presharded`` says so (finding
        out would cost every remote load a listing). A hub id is not."""
        location = getattr(model_config, "model_weights", "") or model_config.model
        if self.options.weights is None and not is_remote(location) and not os.path.isdir(location):
            return None
        source = self._source(model_config, model)
        if not isinstance(source, str):
            return None
        if is_remote(source):
            if not self.options.presharded:
                return None
            files = source_files(source, config=self.options.config)  # each rank's files hold the same names
        elif os.path.isdir(source):
            files = sorted(str(path) for path in Path(source).glob("*.safetensors"))
        else:
            return None
        if not presharded.is_presharded(files):
            if self.options.presharded:
                expected = " or ".join(presharded.PATTERNS)
                raise streamer.SourceError(
                    f"presharded is set, but the files are not named {expected}", path=source
                )
            return None
        return presharded.rank_files(files)

    @staticmethod
    def _log(what: str, seconds: float, device: str, metrics: Metrics, cpus: set[int] | None) -> None:
        nbytes = sum(int(m.get("bytes", 0)) for _, m in metrics)
        nread = sum(int(m.get("bytes_read", 0)) for _, m in metrics)  # a group's rank reads its share
        first = metrics[0][1] if metrics else {}
        why = first.get("memory_limit_source")  # CPU streaming only; a GPU load goes through the ring
        budget = f", memory_limit {first.get('memory_limit')} ({why})" if why else ""
        received = sum(int((m.get("group") or {}).get("received_bytes", 0)) for _, m in metrics)
        hits = sum(int(m.get("cache_hit_bytes", 0)) for _, m in metrics)
        budget += f", {received} from the other ranks" if received else ""
        budget += f", {hits} from the node cache" if hits else ""
        shards = sum(int(m.get("skipped_shards", 0)) for _, m in metrics)
        unused = sum(int(m.get("skipped_bytes", 0)) for _, m in metrics)
        budget += (
            f", {shards} shard(s) of weights the model never loads skipped ({unused} bytes)" if shards else ""
        )
        others = sum(int(m.get("skipped_tensors", 0)) for _, m in metrics)
        others_bytes = sum(int(m.get("skipped_tensor_bytes", 0)) for _, m in metrics)
        budget += (
            f", {others} tensor(s) of other ranks' experts skipped ({others_bytes} bytes)" if others else ""
        )
        sliced = sum(int(m.get("sliced_tensors", 0)) for _, m in metrics)
        unread = sum(int(m.get("sliced_unread_bytes", 0)) for _, m in metrics)
        budget += (
            f", {sliced} tensor(s) read as this rank's tensor-parallel slices ({unread} bytes not read)"
            if sliced
            else ""
        )
        waits = [float(m["consumer_wait_s"]) for _, m in metrics if "consumer_wait_s" in m]
        # The rest of the seconds went to the model: its weight loaders' copies between tensors.
        budget += f", waiting on reads {sum(waits):.2f} s" if waits else ""
        budget += f", on the engine's CPUs {_cpu_list(cpus)} (this worker is pinned)" if cpus else ""
        logger.info(
            "%s %.2f seconds (streamer: %d bytes, %d read here, from %s to %s, %.2f GB/s%s)",
            what,
            seconds,
            nbytes,
            nread,
            " + ".join(dict.fromkeys(where for where, _ in metrics)),  # a source's slices: the same place
            device,
            nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            budget,
        )


def _cpu_list(cpus: set[int]) -> str:
    """``0-3,8``: CPU numbers as ``taskset`` and ``/proc`` write them."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in ranges)
