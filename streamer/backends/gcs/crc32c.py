"""GCS's whole-object check: the CRC32C GCS keeps for every object, compared with the CRC32C of
the bytes a handle read, assembled from pieces landing in any order (``native.crc32c_combine``).

The header read's answer names the object's CRC32C (``x-goog-hash``). Each block's CRC is taken
where it landed (off the event loop: the engine releases the GIL) before the block is credited,
so the block that completes an object is credited only once the object matched: a mismatch fails
the run, and no tensor of it reaches the caller. An object is checked each time a handle has read
every byte of it (the front of the header read, the rest of the header, every tensor); a load of
some tensors of an object leaves it unchecked (the ``checked_objects`` metric says how many were).
"""

from __future__ import annotations

import base64
import bisect
import threading
from collections.abc import Mapping

from streamer.backends.gcs.uri import GcsObject
from streamer.backends.http.objects import StoredObject
from streamer.engine import native
from streamer.errors import ObjectStoreError


def crc32c_from(headers: Mapping[str, str]) -> int | None:
    """The object's CRC32C from an answer's ``x-goog-hash`` (``crc32c=<base64>,md5=<base64>``)."""
    for part in headers.get("x-goog-hash", "").split(","):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "crc32c":
            try:
                digest = base64.b64decode(value.strip(), validate=True)
            except ValueError:
                return None
            return int.from_bytes(digest, "big") if len(digest) == 4 else None
    return None


class Mismatch(Exception):
    """The bytes read are not the object's: ``reason`` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WholeObjectCheck:
    """One object's expected CRC32C and the pieces of it read so far (on one thread: the loop's).

    Pieces are kept sorted and merged where they meet, as ``(begin, end, crc)``; a piece that
    overlaps earlier ones replaces them (a later read of the same bytes).
    """

    def __init__(self, size: int, expected: int, front: bytes) -> None:
        self.size = size
        self.expected = expected
        self._front = front
        self._pieces: list[tuple[int, int, int]] = []

    def add(self, begin: int, end: int, crc: int) -> bool:
        """Records bytes ``[begin, end)`` read with ``crc``; True when they complete the object and
        it matched (the pieces are then dropped, so the next whole read is checked again)."""
        if end <= begin:
            return False
        pieces = self._pieces
        first = bisect.bisect_left(pieces, (begin, -1, -1))
        while first > 0 and pieces[first - 1][1] > begin:
            first -= 1
        last = first
        while last < len(pieces) and pieces[last][0] < end:
            last += 1
        if last < len(pieces) and pieces[last][0] == end:
            end, crc = pieces[last][1], native.crc32c_combine(crc, pieces[last][2], pieces[last][1] - end)
            last += 1
        if first > 0 and pieces[first - 1][1] == begin:
            first -= 1
            begin, crc = pieces[first][0], native.crc32c_combine(pieces[first][2], crc, end - begin)
        pieces[first:last] = [(begin, end, crc)]
        return self._complete()

    def _complete(self) -> bool:
        begin, end, crc = self._pieces[-1]
        if end != self.size or begin > len(self._front):
            return False
        whole = native.crc32c_combine(native.crc32c(self._front[:begin]), crc, end - begin) if begin else crc
        self._pieces.clear()
        if whole != self.expected:
            raise Mismatch(
                f"the bytes read do not match the object's CRC32C (read {whole:#010x}, "
                f"GCS says {self.expected:#010x})"
            )
        return True


class ObjectChecks:
    """The checks of the objects a handle opened, by object; pieces come from the loop's fetches
    and from header reads on the caller's thread, so each ``add`` holds the lock."""

    def __init__(self) -> None:
        self._checks: dict[StoredObject, WholeObjectCheck] = {}
        self._lock = threading.Lock()

    def expect(self, obj: StoredObject, front: bytes) -> None:
        """Starts checking ``obj``, whose first bytes are ``front`` (earlier reads of it are forgotten)."""
        expected = obj.crc32c if isinstance(obj, GcsObject) else None
        if expected is None:
            raise ObjectStoreError(
                "the server named no CRC32C for the object (x-goog-hash), so it cannot be checked "
                "whole (GCSConfig.verify_crc32c=False reads it without the check)",
                bucket=obj.uri.bucket,
                key=obj.uri.key,
                scheme=obj.uri.scheme,
            )
        with self._lock:
            self._checks[obj] = WholeObjectCheck(obj.size, expected, front)

    def add(self, obj: StoredObject, begin: int, end: int, crc: int) -> bool:
        """Records a piece of ``obj`` (see ``WholeObjectCheck.add``); False for an unchecked object."""
        with self._lock:
            check = self._checks.get(obj)
            return check is not None and check.add(begin, end, crc)

    def checks(self, obj: StoredObject) -> bool:
        return obj in self._checks
