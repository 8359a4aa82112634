"""Directories a node shares between loads (the cache, the group loads' shared memory) that no
other local user can write into.

Whoever can write into such a directory can serve weights to every later load: checksums stop
accidents, not people. So each is created for this user alone (0700, files 0600), or, where the
configuration names a group that shares it, for that group (02770: setgid, so everything in it
stays the group's; files 0660), and a directory that already exists is used only if it is the
same: owned by this user (private) or by the group (shared), and never writable by others. A
directory that fails is not used: the caller goes on without it, after one warning.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import NamedTuple

_PRIVATE_DIR, _PRIVATE_FILE = 0o700, 0o600
_SHARED_DIR, _SHARED_FILE = 0o2770, 0o660


class Access(NamedTuple):
    """Who may use a directory: this user alone (``group`` None) or the members of ``group`` (a gid)."""

    group: int | None = None

    @property
    def file_mode(self) -> int:
        return _PRIVATE_FILE if self.group is None else _SHARED_FILE

    def make(self, path: str) -> None:
        """Creates ``path`` and its missing parents, each with this access's mode (the umask aside).
        Raises ``OSError``."""
        parent = os.path.dirname(path.rstrip("/"))
        if parent and not os.path.isdir(parent):
            self.make(parent)
        try:
            os.mkdir(path, _PRIVATE_DIR if self.group is None else _SHARED_DIR)
        except FileExistsError:
            return
        if self.group is not None:
            os.chown(path, -1, self.group)
            os.chmod(path, _SHARED_DIR)  # the umask took the group's bits

    def create(self, path: str, flags: int) -> int:
        """``os.open(path, flags | O_CREAT)`` with this access's file mode, whatever the umask."""
        fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, self.file_mode)
        if self.group is not None:
            try:
                os.fchmod(fd, self.file_mode)
            except OSError:
                os.close(fd)
                raise
        return fd

    def refusal(self, path: str) -> str | None:
        """Why the existing directory ``path`` must not be used, or None when it may."""
        try:
            info = os.stat(path)
        except OSError as error:
            return f"cannot be examined ({error.strerror})"
        if not stat.S_ISDIR(info.st_mode):
            return "is not a directory"
        if info.st_mode & stat.S_IWOTH:
            return f"is writable by every user (mode {stat.filemode(info.st_mode)})"
        if self.group is None:
            if info.st_uid != os.geteuid():
                return f"belongs to another user (uid {info.st_uid}, this process runs as {os.geteuid()})"
            if info.st_mode & stat.S_IWGRP:
                mode = stat.filemode(info.st_mode)
                return f"is writable by its group (mode {mode}); name it as the shared group to share it"
        elif info.st_gid != self.group:
            return f"belongs to group {info.st_gid}, not the shared group {self.group}"
        return None

    def prepare(self, path: str, *, parts: tuple[str, ...] = ()) -> str | None:
        """Makes ``path``, then ``path/part`` for each of ``parts``, where missing; why they must
        not be used, or None when they may. What exists is examined before anything is made in
        it. One that cannot be made (a read-only file system) is left to its user, which reads
        what is there and writes nothing."""
        paths = [path, *(os.path.join(path, part) for part in parts)]
        for making in (False, True):
            for where in paths:
                if making:
                    with contextlib.suppress(OSError):
                        self.make(where)
                if not os.path.lexists(where):
                    continue
                why = self.refusal(where)
                if why is not None:
                    return why if where == path else f"holds {where!r}, which {why}"
        return None
