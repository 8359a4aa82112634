"""Jobs on N threads, as a reference reader spreads its requests (``s3peers``, ``cloudpeers``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

Job = TypeVar("Job")


def on_threads(jobs: Sequence[Job], work: Callable[[Job], None], threads: int) -> None:
    """Runs ``work`` on every job, ``threads`` at a time, taking the next job as one ends; the
    first failure stops the rest and is raised here."""
    pending = iter(jobs)
    lock = threading.Lock()
    failures: list[BaseException] = []

    def loop() -> None:
        while not failures:
            with lock:
                job = next(pending, None)
            if job is None:
                return
            try:
                work(job)
            except BaseException as exc:  # re-raised in the caller's thread
                failures.append(exc)

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures:
        raise failures[0]
