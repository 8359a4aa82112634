"""An object store's storage (S3, GCS, Azure Blob) with the node's cache in front: resolving and
headers go to the store (the header GET gives each object's size and version, an ETag or a
generation: its identity in the cache); each run's blocks are served by a ``CacheFeed`` from the
cache where it holds them and from the store (written through) where not.

A source opened before has a note in the cache (``notes.py``): it is opened provisionally from
the note, at once, while a thread opens it on the store (the listing, the header GETs), so a hit
reads from the cache during the store's answer. A run's feed credits nothing before that answer,
and only if every file the run reads is still the object the store has: otherwise the run fails
with ``StaleOpen`` and is planned again from the fresh open.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from streamer.backends.base import (
    Delivery,
    Extent,
    Feed,
    FileIdentity,
    Named,
    Opened,
    Range,
    StaleOpen,
    Storage,
    StoredFile,
)
from streamer.backends.cache.feed import CacheFeed
from streamer.backends.cache.notes import NOTES_DIR, NoteOf, OpenNotes
from streamer.backends.cache.store import STORE_DIR, CacheWarning, ChunkStore, identity
from streamer.backends.http.storage import ObjectStorage, stored_object
from streamer.backends.sources import SourceLike, source_texts
from streamer.config import CacheConfig
from streamer.engine import native


def usable_directory(config: CacheConfig) -> bool:
    """Whether the cache directory may be used: made if missing, and writable by no other user
    (``streamer.host.safedir``); else one ``CacheWarning`` and the load goes on without the cache."""
    assert config.dir is not None
    why = config.access.prepare(config.dir, parts=(STORE_DIR, NOTES_DIR))
    if why is None:
        return True
    warnings.warn(
        f"streamer cache {config.dir!r} {why}: loading without the cache", CacheWarning, stacklevel=3
    )
    return False


class CachedObjectStorage(Storage):
    """``inner`` with the cache ``config`` describes; the directory is opened on the first run."""

    # Threads copy from chunk buffers and read hits with O_DIRECT: fresh run buffers are best
    # faulted in ahead of them by the prefaulter, as for the S3 feeder's one receiving thread.
    # Blocks on the file's block_size grid: with block_size a multiple of chunk_bytes (both 8 MiB by
    # default) every block holds whole chunks, fetched and written straight from the run's memory.
    delivery = Delivery.ONE_RECEIVER_ON_GRID

    def __init__(self, inner: ObjectStorage[Any], config: CacheConfig) -> None:
        assert config.dir is not None
        self._inner = inner
        self._config = config
        self._place: str | None = None  # of the last source opened
        self._store: ChunkStore | None = None
        self._notes = OpenNotes(config.dir, config.access, inner.stored)
        self._confirmation: _Confirmation | None = None  # of the last open, if it was provisional
        self._confirmations: list[_Confirmation] = []  # every one started, joined by close()

    def open(self, source: SourceLike) -> Opened:
        self._place = self._inner.place(source)
        of = NoteOf(self._place, tuple(source_texts(source)))
        noted = self._notes.read(of)
        if noted is None:
            self._confirmation = None
            opened = self._open_inner(source)
            self._notes.write(of, opened)
            return opened
        self._confirmation = _Confirmation(
            noted, lambda: self._open_inner(source), lambda fresh: self._notes.write(of, fresh)
        )
        self._confirmations.append(self._confirmation)
        return noted

    def _open_inner(self, source: SourceLike) -> Opened:
        """The store's open, its hold on garbage collection ended at once: this storage's runs read
        chunks on threads of their own, and no feed of theirs would end it."""
        try:
            return self._inner.open(source)
        finally:
            self._inner.release_collector()

    def confirm_open(self) -> Opened | None:
        confirmation = self._confirmation
        return None if confirmation is None else confirmation.fresh()

    def read_ranges(self, ranges: Sequence[Range]) -> list[bytes]:
        return self._inner.read_ranges(ranges)

    def identify(self, files: Sequence[StoredFile], *, full: bool) -> list[FileIdentity]:
        return self._inner.identify(files, full=full)

    def feed(
        self, engine: native.Engine, files: Sequence[StoredFile], spans: Sequence[Extent], tensors: Named
    ) -> Feed:
        if self._store is None:
            assert self._config.dir is not None
            self._store = ChunkStore(self._config.dir, self._config.max_bytes, self._config.access)
        objects = [stored_object(file) for file in files]
        idents = [identity(self._place, o.uri.bucket, o.uri.key, o.size, o.version) for o in objects]
        confirmation = self._confirmation
        go_ahead = None if confirmation is None else confirmation.go_ahead(files)
        return CacheFeed(
            self._inner.client,
            self._inner.config,
            self._inner.error_type,
            self._inner.store,
            self._store,
            self._config.chunk_bytes,
            engine,
            objects,
            idents,
            tensors,
            go_ahead,
        )

    def close(self) -> None:
        self._inner.close()  # a confirmation under way fails: its client stops
        for confirmation in self._confirmations:
            confirmation.join()
        self._confirmations = []
        self._inner.close()  # the client of a confirmation that made it after the first close


class _Confirmation:
    """A provisional open (``noted``) and its confirmation by the store, on a thread of its own; a
    fresh open that differs is given to ``note``."""

    def __init__(
        self, noted: Opened, open_fresh: Callable[[], Opened], note: Callable[[Opened], None]
    ) -> None:
        self._noted = noted
        self._open_fresh = open_fresh
        self._note = note
        self._answer: Future[Opened | None] = Future()  # None: the noted open stands
        self._thread = threading.Thread(target=self._confirm, name="streamer-cache-confirm", daemon=True)
        self._thread.start()

    def _confirm(self) -> None:
        try:
            fresh = self._open_fresh()
            changed = None if _same(self._noted, fresh) else fresh
            if changed is not None:
                self._note(changed)
        except BaseException as error:  # the store's typed answer, or a bug's: whoever waits must hear it
            self._answer.set_exception(error)
            return
        self._answer.set_result(changed)

    def fresh(self) -> Opened | None:
        """Waits for the store: None when the provisional open stands, else the fresh one."""
        return self._answer.result()

    def go_ahead(self, files: Sequence[StoredFile]) -> Future[None]:
        """Done once the store has answered: with no result when every one of ``files`` (a run's,
        from the provisional open or the fresh one) is an object it still has, else with the error."""
        ahead: Future[None] = Future()

        def settle(answer: Future[Opened | None]) -> None:
            error = answer.exception()
            if error is None:
                current = {front.file for front in (answer.result() or self._noted).fronts}
                changed = [file for file in files if file not in current]
                if changed:
                    error = StaleOpen(
                        "the object changed in its store since this node's cache noted it",
                        path=changed[0].path,
                    )
            if error is None:
                ahead.set_result(None)
            else:
                ahead.set_exception(error)

        self._answer.add_done_callback(settle)
        return ahead

    def join(self) -> None:
        self._thread.join()


def _same(noted: Opened, fresh: Opened) -> bool:
    """Whether the store's open is the noted one: the same resolution, objects (size, version) and
    headers."""
    if noted.source != fresh.source or len(noted.fronts) != len(fresh.fronts):
        return False
    for old, new in zip(noted.fronts, fresh.fronts, strict=True):
        shorter = min(len(old.data), len(new.data))
        if old.file != new.file or old.data[:shorter] != new.data[:shorter]:
            return False
    return True
