"""Credentials never reach a log: botocore's records (its credential chain's) are masked while a
client is open."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence


class _Redactor(logging.Filter):
    """Masks the credentials of open clients in botocore's DEBUG records.

    botocore's credential chain signs and logs requests of its own (STS for web identity and
    roles: the canonical request, headers, response bodies) at DEBUG level. The filter only
    rewrites records that contain a credential of a client open right now; anything else passes
    unchanged, so installing it changes nothing else about those loggers.
    """

    _LOGGERS = (
        "botocore.auth",
        "botocore.endpoint",
        "botocore.parsers",
        "botocore.credentials",
        "botocore.utils",
    )

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._secrets: dict[str, int] = {}
        self._installed = False

    def add(self, secrets: Sequence[str]) -> None:
        with self._lock:
            if not self._installed:
                self._installed = True
                for name in self._LOGGERS:
                    logging.getLogger(name).addFilter(self)
            for secret in secrets:
                self._secrets[secret] = self._secrets.get(secret, 0) + 1

    def remove(self, secrets: Sequence[str]) -> None:
        with self._lock:
            for secret in secrets:
                left = self._secrets.get(secret, 0) - 1
                if left > 0:
                    self._secrets[secret] = left
                else:
                    self._secrets.pop(secret, None)

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = list(self._secrets)
        if not secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:
            return True
        if any(secret in message for secret in secrets):
            for secret in secrets:
                message = message.replace(secret, "***")
            record.msg, record.args = message, None
        return True


REDACTOR = _Redactor()
