"""Who the S3 client signs as, and for which region: credentials as boto3 finds them.

Explicit credentials (``S3Config``), or the environment's ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY`` where no profile is named, are taken as they are: the first place
boto3's chain looks, found without importing botocore (~0.2 s of a cold start). Anything else
(a named profile, the shared files, web identity, SSO, container or instance roles) is botocore's
own chain (the ``[s3]`` extra), whose refreshable credentials are renewed before they expire. The region is
``S3Config.region``; else a custom endpoint's ``us-east-1`` (what S3-compatible servers expect),
else the profile's.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from streamer.backends.http.client import Fatal
from streamer.backends.optional import require_s3
from streamer.backends.s3.redact import REDACTOR
from streamer.backends.s3.sigv4 import Credentials
from streamer.config import S3Config
from streamer.errors import ConfigError

DEFAULT_REGION = "us-east-1"
NO_CREDENTIALS = "no usable credentials (set them, or use anonymous access for public buckets)"


class Identity:
    """The credentials requests are signed with (none: anonymous) and the region."""

    def __init__(self, config: S3Config) -> None:
        self.region = config.region or DEFAULT_REGION
        self.anonymous = config.anonymous
        self._static: Credentials | None = None
        self._chain: Any = None  # botocore's credentials, where its chain found them
        self._secrets: list[str] = []
        if config.anonymous:
            return
        if config.access_key_id is not None and config.secret_access_key is not None:
            self._static = Credentials(config.access_key_id, config.secret_access_key, config.session_token)
        elif config.profile is None and _environment() is not None:
            self._static = _environment()
        else:
            self._chain, region = _botocore_chain(config)
            if config.region is None and config.endpoint_url is None and region:
                self.region = region
        if self._static is not None:
            self._remember(self._static)

    async def credentials(self) -> Credentials | None:
        """The credentials to sign with now (refreshed first where they are about to expire); a
        ``Fatal`` failure where the chain found none."""
        if self.anonymous or self._static is not None:
            return self._static
        chain = self._chain
        if chain is None:
            raise Fatal(NO_CREDENTIALS, None, "NoCredentials")
        if getattr(chain, "refresh_needed", lambda: False)():
            frozen = await asyncio.get_running_loop().run_in_executor(None, chain.get_frozen_credentials)
        else:
            frozen = chain.get_frozen_credentials()
        found = Credentials(frozen.access_key, frozen.secret_key, frozen.token)
        if found.secret_key not in self._secrets:
            self._remember(found)
        return found

    def _remember(self, credentials: Credentials) -> None:
        """Masks the credentials in botocore's log records while the client is open."""
        found = [s for s in (credentials.access_key, credentials.secret_key, credentials.token) if s]
        REDACTOR.add(found)
        self._secrets += found

    def forget(self) -> None:
        REDACTOR.remove(self._secrets)
        self._secrets = []


def _environment() -> Credentials | None:
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        return None
    token = os.environ.get("AWS_SESSION_TOKEN") or os.environ.get("AWS_SECURITY_TOKEN")
    return Credentials(key, secret, token or None)


def _botocore_chain(config: S3Config) -> tuple[Any, str | None]:
    """botocore's credentials (None when its chain finds none) and the profile's region."""
    require_s3()
    import botocore.exceptions
    import botocore.session

    refused: Exception | None = None
    try:
        session = botocore.session.Session(profile=config.profile)
        return session.get_credentials(), session.get_config_variable("region")
    except botocore.exceptions.BotoCoreError as exc:
        refused = exc
    where = f"endpoint {config.endpoint_url!r}" if config.endpoint_url else "the AWS default endpoint"
    # outside the except block: nothing of botocore's on the chain
    raise ConfigError(f"cannot make an S3 client for {where}: {type(refused).__name__}: {refused}")
