"""Group loads: the ranks of a ``torch.distributed`` group read each byte once and share it.

Contract (every rank of the group must keep it, or the others raise after ``group_timeout``):

- every rank opens the same checkpoint (the files may be separate copies; checked before a byte
  moves, ``identity.py``: each file's size, whole header and version) and makes the same group
  calls in the same order: ``load``, ``load_into``
  and iterating a ``Streamer`` opened with ``group=``. ``get_tensor`` and ``read`` never use
  the group (each rank reads for itself);
- every rank asks for the same tensors (checked: a mismatch is a ``ConfigError`` on every rank);
- tensors come out in the group's plan order (``order="completion"``); ``order="checkpoint"``
  still yields in checkpoint order, later.

``plan.py`` decides, identically on every rank, which rank reads which bytes; ``exchange.py``
reads this rank's share through an ordinary run and moves every piece from its reader to the
ranks that want it: through shared memory between ranks of one host (``shared.py``), else with
the group's collectives.
"""
