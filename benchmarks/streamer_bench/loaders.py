"""The loaders we compare: what each needs installed, which knobs it has, how each setting runs.

Parent-side only: nothing here imports a loader. ``child`` does the loading.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALL_LOADERS = (
    "streamer", "safetensors", "runai", "fastsafetensors", "instanttensor", "tensorizer",
    "boto3", "gcs_sdk", "azure_sdk",
)  # fmt: skip
# Remote sources by scheme: s3://, gs://, and Azure Blob (az://, or the portal's https:// URLs).
SCHEMES = ("s3", "gs", "az")
# streamer as another interpreter has it installed (--baseline PYTHON, e.g. the previous commit's
# venv), run like a peer so that an A/B of two versions is paired by round in one run.
BASELINE = "baseline"
RUNAI_DEFAULT_STRATEGY = "default"  # RUNAI_STREAMER_FS_STRATEGY unset: io_uring + O_DIRECT in 0.17
RUNAI_STRATEGIES = (RUNAI_DEFAULT_STRATEGY, "sync_buffered")
SAFETENSORS_BACKENDS = ("mmap", "pread")

# Environment variables a setting controls; removed from the child's environment unless the
# setting sets them, so a stray export in the user's shell cannot skew a "default" run.
CONTROLLED_ENV = (
    "RUNAI_STREAMER_CONCURRENCY",
    "RUNAI_STREAMER_FS_STRATEGY",
    "STREAMER_CONCURRENCY",
    "STREAMER_S3_CONCURRENCY",
    "STREAMER_GCS_CONCURRENCY",
    "STREAMER_AZURE_CONCURRENCY",
)


@dataclass(frozen=True)
class RemoteSupport:
    """What a loader needs to read one store's sources: modules that must import, and their install."""

    modules: tuple[str, ...]
    pip: str | None


@dataclass(frozen=True)
class LoaderInfo:
    """Static facts about one loader."""

    name: str
    module: str  # must import for the loader to count as installed
    pip: str  # how to install it
    concurrency_knob: str | None  # what --sweep concurrency sets, in words
    cuda_only: bool
    description: str
    remote: dict[str, RemoteSupport] = field(default_factory=dict)  # by scheme; none: local files only
    reference_of: str | None = None  # a store's reference (its SDK's reads), not a loader of local files


LOADERS: dict[str, LoaderInfo] = {
    info.name: info
    for info in (
        LoaderInfo(
            "streamer",
            "streamer",
            "pip install streamer-weights",
            "StreamerConfig(concurrency=N); S3Config, GCSConfig, AzureConfig(concurrency=N) remote",
            False,
            "streamer.load(source, device, config)",
            {
                "s3": RemoteSupport(("boto3",), "pip install boto3"),  # boto3: the bench's uploads
                "gs": RemoteSupport(("google.auth",), "pip install 'streamer-weights[gcs]'"),
                "az": RemoteSupport(("azure.identity",), "pip install 'streamer-weights[azure]'"),
            },
        ),
        LoaderInfo(
            "safetensors",
            "safetensors",
            "pip install safetensors",
            None,
            False,
            "safetensors.torch.load_file per shard; mmap views cloned into owned memory; "
            "remote: the store's SDK downloads each shard to $TMPDIR first (timed)",
            {
                "s3": RemoteSupport(("boto3",), "pip install boto3"),
                "gs": RemoteSupport(("google.cloud.storage",), "pip install google-cloud-storage"),
                "az": RemoteSupport(("azure.storage.blob",), "pip install azure-storage-blob"),
            },
        ),
        LoaderInfo(
            "runai",
            "runai_model_streamer",
            "pip install runai-model-streamer",
            "RUNAI_STREAMER_CONCURRENCY=N",
            False,
            "SafetensorsStreamer.stream_files(all shards) + get_tensors()",
            {
                "s3": RemoteSupport(("runai_model_streamer_s3",), "pip install runai-model-streamer-s3"),
                "gs": RemoteSupport(("runai_model_streamer_gcs",), "pip install runai-model-streamer-gcs"),
                "az": RemoteSupport(
                    ("runai_model_streamer_azure",), "pip install runai-model-streamer-azure"
                ),
            },
        ),
        LoaderInfo(
            "fastsafetensors",
            "fastsafetensors",
            "pip install fastsafetensors",
            "max_threads=N",
            False,
            "SafeTensorsFileLoader(nogds=True).copy_files_to_device()",
        ),
        LoaderInfo(
            "instanttensor",
            "instanttensor",
            "pip install instanttensor",
            None,
            True,
            "instanttensor.safe_open(all shards).tensors(), each tensor cloned",
        ),
        LoaderInfo(
            "tensorizer",
            "tensorizer",
            "pip install tensorizer",
            "num_readers=N",
            False,
            "TensorDeserializer(converted .tensors file, num_readers); conversion untimed",
        ),
        LoaderInfo(
            "boto3",
            "boto3",
            "pip install boto3",
            "N connections (threads)",
            False,
            "plain boto3 16 MiB ranged GETs into fresh anonymous memory: the S3 ceiling, not a loader",
            {"s3": RemoteSupport((), None)},
            reference_of="s3",
        ),
        LoaderInfo(
            "gcs_sdk",
            "google.cloud.storage",
            "pip install google-cloud-storage",
            "N threads",
            False,
            "google-cloud-storage download_as_bytes of 16 MiB ranges on N threads into fresh memory",
            {"gs": RemoteSupport((), None)},
            reference_of="gs",
        ),
        LoaderInfo(
            "azure_sdk",
            "azure.storage.blob",
            "pip install azure-storage-blob",
            "max_concurrency=N",
            False,
            "azure-storage-blob download_blob(max_concurrency=N).readinto fresh memory",
            {"az": RemoteSupport((), None)},
            reference_of="az",
        ),
    )
}


@dataclass(frozen=True)
class Setting:
    """One configuration of one loader; ``knobs`` is empty for its defaults."""

    loader: str
    knobs: tuple[tuple[str, str | int], ...] = field(default=())
    python: str | None = None  # the interpreter of the baseline setting; None: this one

    @property
    def child_loader(self) -> str:
        """What the child loads: the baseline is streamer, from its own interpreter's install."""
        return "streamer" if self.loader == BASELINE else self.loader

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.knobs) or "default"

    def knob(self, name: str) -> str | int | None:
        return dict(self.knobs).get(name)

    def environment(self) -> dict[str, str]:
        """Process-global variables this setting needs in the child."""
        env: dict[str, str] = {}
        if self.loader == "runai":
            concurrency = self.knob("concurrency")
            strategy = self.knob("strategy")
            if concurrency is not None:
                env["RUNAI_STREAMER_CONCURRENCY"] = str(concurrency)
            if strategy is not None and strategy != RUNAI_DEFAULT_STRATEGY:
                env["RUNAI_STREAMER_FS_STRATEGY"] = str(strategy)
        return env


INTO_SETTING = Setting("streamer", (("into", "touched"),))
UNCHECKED_SETTING = Setting("streamer", (("crc32c", "off"),))  # GCS without the whole-object check


def settings_for(
    loader: str,
    concurrency: list[int],
    runai_strategies: list[str],
    safetensors_backends: list[str],
    *,
    into_touched: bool = False,
    unchecked: bool = False,
) -> list[Setting]:
    """Every setting of ``loader`` to run: its defaults, then each swept value (and strategy).

    ``into_touched``: streamer also times ``load_into`` of destination tensors allocated and
    touched before the clock (what a reloaded model or a GPU ring sees): the I/O path alone.
    ``unchecked``: streamer also loads without GCS's whole-object CRC32C check (its cost, as a row)."""
    if loader == "streamer" and (into_touched or unchecked):
        extra = [INTO_SETTING] if into_touched else [UNCHECKED_SETTING]
        return [*settings_for(loader, concurrency, runai_strategies, safetensors_backends), *extra]
    levels: list[tuple[tuple[str, str | int], ...]] = [()]
    if LOADERS[loader].concurrency_knob is not None:
        levels += [(("concurrency", c),) for c in concurrency]
    if loader == "runai":
        return [
            Setting(loader, level + ((("strategy", s),) if s != RUNAI_DEFAULT_STRATEGY else ()))
            for s in runai_strategies
            for level in levels
        ]
    if loader == "safetensors":
        return [Setting(loader, (("backend", b),) if b != "mmap" else ()) for b in safetensors_backends]
    return [Setting(loader, level) for level in levels]


def default_loaders(scheme: str | None) -> list[str]:
    """``--loaders`` when not given: every loader, and a store's SDK reference for its own sources
    only (local sources have their own read ceilings)."""
    return [name for name in ALL_LOADERS if LOADERS[name].reference_of in (None, scheme)]
