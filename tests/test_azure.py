"""Azure Blob sources against a real Azure emulator on 127.0.0.1 (Azurite, installed with npm by
``scripts/setup.sh``), with the fault proxy in front of it where a test needs a misbehaving server.

Every source form (one blob, a prefix with or without its slash, an index, a list) and every API
must be bit-exact with ``safetensors``, through each way of authorising (connection string, account
key, SAS token); missing blobs and containers are typed errors naming the URI; a replaced blob is
the new bytes between two loads and a typed error during one; transient faults are retried,
persistent ones fail typed; no secret appears in an error; nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from azurite_server import ACCOUNT, KEY, Azurite, binary
from conftest import (
    FAST_BOUNDS,
    TORCH_DTYPE,
    KiB,
    Written,
    assert_same,
    assert_same_dict,
    bench_report,
    fd_count,
    random_tensor,
    reference_load,
    settled_thread_count,
    thread_count,
    write_checkpoint,
)
from s3_faults import FaultProxy, any_get

import streamer
from streamer import (
    AzureConfig,
    CacheConfig,
    ObjectMissingError,
    ObjectSourceError,
    ObjectStoreError,
    StreamerConfig,
)
from streamer.errors import ConfigError, SourceError

pytest.importorskip("azure.storage.blob")
pytest.importorskip("azure.identity")
AZURITE = binary()
pytestmark = pytest.mark.skipif(AZURITE is None, reason="Azurite is not installed (bash scripts/setup.sh)")

CONTAINER = "weights"
SINGLE = f"az://{CONTAINER}/single/model.safetensors"


def azure_config(endpoint: str, **overrides: Any) -> StreamerConfig:
    """The emulator's account by its key, with bounds small enough that failures end fast."""
    values: dict[str, Any] = {"account": ACCOUNT, "account_key": KEY, "endpoint_url": endpoint, **FAST_BOUNDS}
    values.update(overrides)
    return StreamerConfig(azure=AzureConfig(**values), block_size=64 * KiB)


@pytest.fixture(scope="module")
def azurite() -> Iterator[Azurite]:
    assert AZURITE is not None
    server = Azurite(AZURITE)
    try:
        yield server
    finally:
        server.close()


def _upload(azurite: Azurite, prefix: str, files: list[Path]) -> None:
    container: Any = azurite.container(CONTAINER)
    for path in files:
        container.upload_blob(prefix + path.name, path.read_bytes(), overwrite=True)


@pytest.fixture(scope="module")
def sharded(azurite: Azurite, tmp_path_factory: pytest.TempPathFactory) -> Written:
    g = torch.Generator().manual_seed(17)
    tensors = {f"t.{name}": random_tensor((37, 29), dtype, g) for name, dtype in TORCH_DTYPE.items()}
    tensors["big"] = random_tensor((700, 300), torch.float32, g)
    tensors["empty"] = torch.zeros(0, 5)
    written = write_checkpoint(tmp_path_factory.mktemp("sharded"), tensors, shards=3)
    assert written.index is not None
    _upload(azurite, "sharded/", [*written.shards, written.index])
    return written


@pytest.fixture(scope="module")
def single(azurite: Azurite, tmp_path_factory: pytest.TempPathFactory) -> Written:
    g = torch.Generator().manual_seed(18)
    tensors = {"a": random_tensor((512, 640), torch.bfloat16, g), "b": random_tensor((1000,), torch.int64, g)}
    written = write_checkpoint(tmp_path_factory.mktemp("single"), tensors, index=False)
    _upload(azurite, "single/", list(written.shards))
    return written


@pytest.fixture
def proxy(azurite: Azurite) -> Iterator[FaultProxy]:
    host, port = azurite.endpoint.removeprefix("http://").split("/")[0].split(":")
    faults = FaultProxy((host, int(port)), stall_seconds=3.0)
    try:
        yield faults
    finally:
        faults.close()


def _through(proxy: FaultProxy) -> str:
    return f"{proxy.endpoint_url}/{ACCOUNT}"


# --- sources, APIs, credentials ------------------------------------------------------------------


def test_every_source_form_is_bit_exact(azurite: Azurite, sharded: Written) -> None:
    expected = reference_load(sharded.shards)
    config = azure_config(azurite.endpoint)
    for source in (
        f"az://{CONTAINER}/sharded/model.safetensors.index.json",
        f"az://{CONTAINER}/sharded/",
        f"az://{CONTAINER}/sharded",
        [f"az://{CONTAINER}/sharded/{path.name}" for path in sharded.shards],
    ):
        got = streamer.load(source, config=config)
        assert list(got) == list(expected), source
        assert_same_dict(got, expected)


def test_every_api_is_bit_exact(azurite: Azurite, single: Written) -> None:
    config = azure_config(azurite.endpoint)
    expected = reference_load(single.shards)
    assert_same_dict(streamer.load_file(SINGLE, config=config), expected)
    with streamer.open(SINGLE, config=config) as handle:
        assert_same_dict(dict(iter(handle)), expected)
        metrics = handle.metrics
    assert metrics["azure_files"] == 1 and metrics["retries"] == 0
    dest = {name: torch.empty_like(tensor) for name, tensor in expected.items()}
    streamer.load_into(dest, SINGLE, config=config)
    assert_same_dict(dest, expected)
    with (
        streamer.safe_open(SINGLE, "pt", config=config) as ours,
        safetensors.safe_open(single.shards[0], "pt") as theirs,
    ):
        assert_same(ours.get_slice("a")[100:130, 7:300], theirs.get_slice("a")[100:130, 7:300])


def test_a_connection_string_and_a_sas_token_authorise_too(azurite: Azurite, single: Written) -> None:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    expected = reference_load(single.shards)
    by_string = StreamerConfig(azure=AzureConfig(connection_string=azurite.connection_string))
    assert_same_dict(streamer.load(SINGLE, config=by_string), expected)
    sas = generate_container_sas(
        ACCOUNT,
        CONTAINER,
        account_key=KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )
    by_sas = StreamerConfig(azure=AzureConfig(account=ACCOUNT, sas_token=sas, endpoint_url=azurite.endpoint))
    assert_same_dict(streamer.load(f"az://{CONTAINER}/single/", config=by_sas), expected)
    assert "***" in repr(by_sas.azure) and sas not in repr(by_sas.azure)


def test_a_wrong_key_is_a_source_error_that_shows_no_secret(azurite: Azurite, single: Written) -> None:
    wrong = "d3Jvbmcta2V5LVNFTlRJTkVMLXZhbHVlLXBhZGRlZC10by02NC1ieXRlcy1sb25nLXBsZWFzZQ=="
    with pytest.raises(ObjectSourceError, match="access denied") as info:
        streamer.load(SINGLE, config=azure_config(azurite.endpoint, account_key=wrong))
    shown = f"{info.value!r} {info.value} {info.value.__context__!r} {info.value.__cause__!r}"
    assert wrong not in shown and "sig=" not in shown and info.value.status == 403


def test_portal_urls_name_their_account() -> None:
    with pytest.raises(SourceError, match="Azure Blob URLs"):
        streamer.load("https://example.com/models/model.safetensors")
    with pytest.raises(ConfigError, match="names account 'other'"):
        config = StreamerConfig(azure=AzureConfig(account="mine", account_key=KEY))
        streamer.load("https://other.blob.core.windows.net/models/model.safetensors", config=config)


def test_no_account_is_a_config_error_saying_how() -> None:
    with pytest.raises(ConfigError, match="AZURE_STORAGE_ACCOUNT"):
        streamer.load(f"az://{CONTAINER}/model.safetensors", config=StreamerConfig(azure=AzureConfig()))


# --- missing, replaced ---------------------------------------------------------------------------


def test_missing_blobs_and_containers_are_file_not_found_errors(azurite: Azurite, sharded: Written) -> None:
    config = azure_config(azurite.endpoint)
    with pytest.raises(ObjectMissingError, match="no such blob") as info:
        streamer.load(f"az://{CONTAINER}/nowhere/model.safetensors", config=config)
    assert isinstance(info.value, FileNotFoundError) and info.value.code == "BlobNotFound"
    with pytest.raises(ObjectMissingError, match="no such container"):
        streamer.load("az://no-such-container/model.safetensors", config=config)
    assert sharded.index is not None
    _upload(azurite, "partial/", [sharded.index, sharded.shards[0]])
    with pytest.raises(ObjectMissingError, match="references 2 missing shard"):
        streamer.load(f"az://{CONTAINER}/partial/model.safetensors.index.json", config=config)


def test_a_replaced_blob_is_new_bytes_next_load_and_an_error_during_one(azurite: Azurite) -> None:
    container: Any = azurite.container(CONTAINER)
    key, source = "replaced/model.safetensors", f"az://{CONTAINER}/replaced/model.safetensors"
    config = azure_config(azurite.endpoint)
    tensors = {f"t{i}": torch.full((64 * KiB,), float(i)) for i in range(8)}
    container.upload_blob(key, safetensors.torch.save(tensors), overwrite=True)
    assert torch.equal(streamer.load(source, config=config)["t3"], tensors["t3"])
    container.upload_blob(key, safetensors.torch.save({k: -v for k, v in tensors.items()}), overwrite=True)
    assert torch.equal(streamer.load(source, config=config)["t3"], -tensors["t3"])
    with streamer.open(source, config=config) as handle:
        container.upload_blob(key, safetensors.torch.save(tensors), overwrite=True)
        got: dict[str, torch.Tensor] = {}
        with pytest.raises(ObjectStoreError, match="changed") as info:
            for name, tensor in handle:
                got[name] = tensor
    assert not got and info.value.path == source and info.value.status == 412


# --- faults --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["503", "500", "reset", "short"])
def test_transient_faults_are_retried(proxy: FaultProxy, single: Written, kind: str) -> None:
    proxy.inject(kind, times=3)
    with streamer.open(SINGLE, config=azure_config(_through(proxy))) as handle:
        assert_same_dict(dict(iter(handle)), reference_load(single.shards))
        assert handle.metrics["retries"] >= 3
    assert proxy.injected == 3


def test_faults_on_the_header_read_are_retried(proxy: FaultProxy, single: Written) -> None:
    proxy.inject("503", times=2, match=any_get)
    assert_same_dict(
        streamer.load(SINGLE, config=azure_config(_through(proxy))), reference_load(single.shards)
    )


def test_persistent_faults_fail_typed_naming_the_blob(proxy: FaultProxy, single: Written) -> None:
    proxy.inject("503", times=None)
    with pytest.raises(ObjectStoreError, match="gave up") as info:
        streamer.load(SINGLE, config=azure_config(_through(proxy), max_attempts=3))
    assert info.value.path == SINGLE and info.value.status == 503 and info.value.attempts == 3


# --- packaging, resources ------------------------------------------------------------------------


def test_without_the_extra_the_error_names_the_pip_command() -> None:
    code = (
        "import sys; sys.modules['azure.identity'] = None\n"
        "import streamer\n"
        "try:\n    streamer.load('az://c/m.safetensors')\n"
        "except streamer.ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert "pip install 'streamer-weights[azure]'" in out.stdout, out.stderr


def test_import_streamer_does_not_import_the_azure_modules() -> None:
    code = "import sys, streamer; print(sorted(m for m in sys.modules if m.startswith('azure')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.stdout.strip() == "[]", out.stderr


def test_nothing_is_left_behind(azurite: Azurite, single: Written) -> None:
    config = azure_config(azurite.endpoint)
    streamer.load(SINGLE, config=config)  # imports and first-use costs
    threads, fds = thread_count(), fd_count()
    for _ in range(3):
        with streamer.open(SINGLE, config=config) as handle:
            dict(iter(handle))
        with pytest.raises(ObjectMissingError):
            streamer.load(f"az://{CONTAINER}/nowhere.safetensors", config=config)
    assert settled_thread_count(threads) <= threads
    assert fd_count() <= fds


def test_the_node_cache_serves_the_next_load_and_follows_the_etag(azurite: Azurite, tmp_path: Path) -> None:
    """With ``StreamerConfig.cache`` a load fills the node's cache, keyed by each blob's ETag; the
    next reads every byte from it, bit-exact and without a data GET; a replaced blob is fetched
    anew, never the old bytes."""
    container: Any = azurite.container(CONTAINER)
    key = "cached/model.safetensors"
    cache = CacheConfig(dir=str(tmp_path / "cache"), chunk_bytes=64 * KiB)
    # Write slots (one per GET in flight) for every chunk: none is dropped for a disk behind.
    config = dataclasses.replace(azure_config(azurite.endpoint, concurrency=32), cache=cache)
    before = {f"t{i}": torch.full((40 * KiB,), float(i)) for i in range(6)}
    container.upload_blob(key, safetensors.torch.save(before), overwrite=True)
    source = f"az://{CONTAINER}/{key}"
    with streamer.open(source, config=config) as handle:
        assert_same_dict(dict(iter(handle)), before)
        first = handle.metrics
    assert first["azure_files"] == 1 and first["cache_write_bytes"] > 0 and first["cache_errors"] == 0
    with streamer.open(source, config=config) as handle:
        assert_same_dict(dict(iter(handle)), before)
        second = handle.metrics
    assert second["requests"] == 0 and second["cache_hit_bytes"] == second["bytes"] > 0
    after = {name: -tensor for name, tensor in before.items()}
    container.upload_blob(key, safetensors.torch.save(after), overwrite=True)
    with streamer.open(source, config=config) as handle:
        assert_same_dict(dict(iter(handle)), after)
        assert handle.metrics["cache_hit_bytes"] == 0


def test_the_bench_reads_azure_sources_with_the_sdk_as_peer(azurite: Azurite, tmp_path: Path) -> None:
    """``streamer-bench --synthetic --upload az://…``: uploaded through Azurite, then read by
    streamer, the SDK's download + safetensors and the SDK's parallel reads (the ceiling)."""
    pytest.importorskip("azure.storage.blob")
    env = {"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string}
    args = ["--synthetic", "2MiB", "--upload", f"az://{CONTAINER}/bench/", "--repeat", "1"]
    run = bench_report(tmp_path, *args, "--loaders", "streamer,safetensors,azure_sdk,boto3", env=env)
    doc = run["json"]
    (section,) = doc["sections"]
    by_loader = {r["loader"]: r for r in section["results"]}
    assert {s["loader"] for s in doc["skipped"]} == {"boto3"}
    files = {f["path"]: f["bytes"] for f in doc["checkpoint"]["files"]}
    assert all(path.startswith(f"az://{CONTAINER}/bench/") for path in files)
    for loader in ("streamer", "safetensors"):
        assert (
            by_loader[loader]["status"] == "ok"
            and by_loader[loader]["bytes"] == doc["checkpoint"]["tensor_bytes"]
        )
    assert by_loader["azure_sdk"]["status"] == "ok" and by_loader["azure_sdk"]["bytes"] == sum(files.values())
    assert {c["name"]: c for c in section["ceilings"]}["sdk_read"]["gbps"] is not None
