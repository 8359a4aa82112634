"""A Hugging Face hub cache written by hand, as ``huggingface_hub`` lays one out (no hub needed).

``models--ORG--NAME/refs/REV`` holds a commit hash; ``snapshots/COMMIT/FILE`` links to
``blobs/SHA256``. vLLM's download helpers find a cached revision there offline, or when the hub
cannot be reached.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def populate(cache: Path, repo_id: str, revisions: dict[str, Path]) -> dict[str, str]:
    """Caches every file of each model directory as revision REV of ``repo_id``; returns REV -> commit."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    commits: dict[str, str] = {}
    for revision, directory in revisions.items():
        commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
        commits[revision] = commit
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / revision).write_text(commit)
        snapshot = root / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for path in sorted(directory.iterdir()):
            data = path.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    return commits
