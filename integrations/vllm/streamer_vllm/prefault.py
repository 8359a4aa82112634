"""The model's CPU parameters faulted in on a thread of their own while the weights stream in.

vLLM makes a model's parameters with ``torch.empty``: memory no page backs yet. Each weight
loader's copy then faults its parameter in, 4 KiB at a time (~262,000 faults per GiB), on the one
thread that runs every loader, and on the CPU that first touch is most of the seconds a load spends
outside the reads (the plugin's line says how long vLLM waited on reads; the rest is the model's).
Faulting the parameters in ahead, in the model's order, on another thread, takes it off that path.
Populating never writes, so it is safe beside the loaders' copies, and a parameter already touched
(a reload) costs a walk of its page table.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

from torch import nn

from streamer.destinations.buffers import Prefaulter

PAGE = 4096


def cpu_storage_pages(model: nn.Module) -> list[tuple[int, int]]:
    """The whole pages of each CPU parameter's and buffer's storage, once each, in the model's
    order: (address, bytes). Pages shared with a neighbouring allocation are left to the copies."""
    seen: set[int] = set()
    ranges = []
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if address in seen or size == 0:
            continue
        seen.add(address)
        begin = -(-address // PAGE) * PAGE
        end = (address + size) // PAGE * PAGE
        if end > begin:
            ranges.append((begin, end - begin))
    return ranges


@contextlib.contextmanager
def parameters_faulted_in(model: nn.Module) -> Iterator[None]:
    """Faults the model's CPU parameters in on a thread while the block runs; on leaving, what is
    still queued is dropped (the copies fault those pages in themselves)."""
    prefaulter = Prefaulter()
    try:
        for address, size in cpu_storage_pages(model):
            prefaulter.submit(address, size)
        yield
    finally:
        prefaulter.close()
