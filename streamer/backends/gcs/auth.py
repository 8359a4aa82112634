"""Bearer tokens for GCS requests, from google-auth's Application Default Credentials.

Refreshed before they expire and after the server refused one (401), on a worker thread (the
refresh is a blocking HTTP call): a long load never fails for a token that aged during it. A token
never appears in an error, a log line or a metric: it is sent in a header and nowhere else.
"""

from __future__ import annotations

import asyncio
from typing import Any

from streamer.errors import ConfigError

READ_ONLY = "https://www.googleapis.com/auth/devstorage.read_only"


class Tokens:
    """The ``Authorization`` header of a session: none when anonymous (public buckets, emulators)."""

    def __init__(self, *, anonymous: bool) -> None:
        self._credentials: Any = None if anonymous else _default_credentials()
        self._stale = False
        self._lock = asyncio.Lock()

    async def header(self) -> dict[str, str]:
        credentials = self._credentials
        if credentials is None:
            return {}
        async with self._lock:  # one refresh for every request waiting on it
            if self._stale or not credentials.valid:
                await asyncio.get_running_loop().run_in_executor(None, _refresh, credentials)
                self._stale = False
        return {"Authorization": f"Bearer {credentials.token}"}

    def refused(self) -> None:
        """The server refused the token (401): the next request refreshes it first."""
        self._stale = True


def _default_credentials() -> Any:
    import google.auth
    import google.auth.exceptions

    try:
        credentials, _ = google.auth.default(scopes=[READ_ONLY])
    except google.auth.exceptions.DefaultCredentialsError:
        pass  # raised below, outside the handler: nothing of google-auth's on the chain
    else:
        return credentials
    raise ConfigError(
        "no Google credentials found: set GOOGLE_APPLICATION_CREDENTIALS to a service-account file, "
        "run `gcloud auth application-default login`, run where the metadata server answers "
        "(GKE workload identity, GCE), or use GCSConfig(anonymous=True) for a public bucket"
    )


def _refresh(credentials: Any) -> None:
    from google.auth.transport.requests import Request

    credentials.refresh(Request())
