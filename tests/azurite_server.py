"""Azurite's blob service on 127.0.0.1 for the Azure tests: the ``azurite-blob`` that
``scripts/setup.sh`` installs with npm (``STREAMER_AZURITE``, else ``~/.cache/streamer-ci/azurite``),
on a free port with a directory of its own, and the account's well-known development key."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import stop_process

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def binary() -> Path | None:
    """The ``azurite-blob`` to run, or None where it is not installed."""
    root = Path(os.environ.get("STREAMER_AZURITE", Path.home() / ".cache" / "streamer-ci" / "azurite"))
    found = root / "node_modules" / ".bin" / "azurite-blob"
    return found if found.exists() and shutil.which("node") else None


class Azurite:
    """One Azurite blob service; ``endpoint`` is the account's blob endpoint."""

    def __init__(self, program: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
        self._directory = tempfile.mkdtemp(prefix="azurite-")
        self._process = subprocess.Popen(
            [str(program), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", self._directory,
             "--silent", "--skipApiVersionCheck", "--loose"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    self.close()
                    raise RuntimeError("Azurite did not start") from None
                time.sleep(0.1)

    @property
    def connection_string(self) -> str:
        fields = {
            "DefaultEndpointsProtocol": "http",
            "AccountName": ACCOUNT,
            "AccountKey": KEY,
            "BlobEndpoint": self.endpoint,
        }
        return "".join(f"{name}={value};" for name, value in fields.items())

    def container(self, name: str) -> object:
        """A container client of the SDK (for uploads), the container made if needed."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        client = BlobServiceClient.from_connection_string(self.connection_string).get_container_client(name)
        with contextlib.suppress(ResourceExistsError):
            client.create_container()
        return client

    def close(self) -> None:
        stop_process(self._process)
        shutil.rmtree(self._directory, ignore_errors=True)
