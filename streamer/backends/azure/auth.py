"""Where an Azure Blob account is and how its requests are authorised, from an ``AzureConfig``.

First found wins: a SAS token (the configuration's, else the connection string's); an account key
(the configuration's, else the connection string's), with which a read-and-list SAS of each
container is signed here and signed again when half its hour has passed; anonymous; else
azure-identity's ``DefaultAzureCredential``, whose bearer token is refreshed before it expires and
after a 401. No secret appears in an error, a log line or a metric: a SAS travels in the query, a
token in a header, and errors name the blob's ``az://`` URI only.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from streamer.config import AzureConfig
from streamer.errors import ConfigError

API_VERSION = "2021-08-06"
STORAGE_SCOPE = "https://storage.azure.com/.default"
_SAS_SECONDS = 3600
# Azurite's well-known development account (UseDevelopmentStorage=true), public by design.
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass(frozen=True)
class Account:
    """The account's name, its blob endpoint (no trailing slash) and its static secrets."""

    name: str
    endpoint: str
    key: str | None
    sas: str | None


def account_of(config: AzureConfig, named: str | None) -> Account:
    """The account ``config`` describes; ``named``: the account a portal URL names (wins over
    ``AZURE_STORAGE_ACCOUNT``, must agree with an explicit ``AzureConfig.account``)."""
    fields = _connection_fields(config.connection_string)
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        fields = {
            "accountname": _DEV_ACCOUNT,
            "accountkey": _DEV_KEY,
            "blobendpoint": f"http://127.0.0.1:10000/{_DEV_ACCOUNT}",
        }
    name = named or config.account or fields.get("accountname")
    if named and config.account and named != config.account:
        raise ConfigError(f"the URL names account {named!r}, AzureConfig.account is {config.account!r}")
    if not name:
        raise ConfigError(
            "no Azure storage account: set AZURE_STORAGE_ACCOUNT (or AzureConfig.account), give "
            "AZURE_STORAGE_CONNECTION_STRING, or use the URL https://<account>.blob.core.windows.net/..."
        )
    protocol = fields.get("defaultendpointsprotocol", "https")
    suffix = fields.get("endpointsuffix", "core.windows.net")
    endpoint = config.endpoint_url or fields.get("blobendpoint") or f"{protocol}://{name}.blob.{suffix}"
    key = config.account_key or fields.get("accountkey")
    sas = config.sas_token or fields.get("sharedaccesssignature")
    return Account(name, endpoint.rstrip("/"), key, sas.lstrip("?") if sas else None)


def _connection_fields(text: str | None) -> dict[str, str]:
    """``Name=value;...`` of a connection string, names lower-cased (values may hold ``=``)."""
    fields: dict[str, str] = {}
    for part in (text or "").split(";"):
        name, equals, value = part.partition("=")
        if equals and name.strip():
            fields[name.strip().lower()] = value.strip()
    if text and not fields:
        raise ConfigError("AZURE_STORAGE_CONNECTION_STRING has no Name=value fields")
    return fields


class Authorization:
    """The query and headers that authorise a request to one account, now."""

    def __init__(self, account: Account, *, anonymous: bool) -> None:
        self._account = account
        self._signed: dict[str, tuple[str, float]] = {}  # container -> (SAS, when signed)
        self._credential: Any = None
        self._token: Any = None
        self._stale = False
        self._lock = asyncio.Lock()
        if account.sas is None and account.key is None and not anonymous:
            self._credential = _default_credential()

    async def for_container(self, container: str) -> tuple[dict[str, str], str]:
        headers = {"x-ms-version": API_VERSION}
        if self._account.sas is not None:
            return headers, self._account.sas
        if self._account.key is not None:
            return headers, self._container_sas(container)
        if self._credential is not None:
            headers["Authorization"] = f"Bearer {await self._bearer()}"
        return headers, ""

    def refused(self) -> None:
        """The server refused the token (401): the next request fetches a fresh one first."""
        self._stale = True

    def _container_sas(self, container: str) -> str:
        now = time.monotonic()
        cached = self._signed.get(container)
        if cached is None or now - cached[1] > _SAS_SECONDS / 2:
            from azure.storage.blob import ContainerSasPermissions, generate_container_sas

            start = datetime.now(timezone.utc) - timedelta(minutes=5)  # a server's clock behind ours
            sas = generate_container_sas(
                self._account.name,
                container,
                account_key=self._account.key,
                permission=ContainerSasPermissions(read=True, list=True),
                start=start,
                expiry=start + timedelta(seconds=_SAS_SECONDS + 300),
            )
            cached = (sas, now)
            self._signed[container] = cached
        return cached[0]

    async def _bearer(self) -> str:
        async with self._lock:  # one refresh for every request waiting on it
            token = self._token
            if self._stale or token is None or token.expires_on - time.time() < 300:
                loop = asyncio.get_running_loop()
                self._token = await loop.run_in_executor(None, self._credential.get_token, STORAGE_SCOPE)
                self._stale = False
            return str(self._token.token)


def _default_credential() -> Any:
    from azure.identity import DefaultAzureCredential

    return DefaultAzureCredential()
