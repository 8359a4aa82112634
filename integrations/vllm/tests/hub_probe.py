"""Calls the plugin's loader directly, as vLLM would, for model ids; prints ``RESULT {json}``.

``python hub_probe.py DOWNLOAD_DIR MODEL_ID@REVISION…`` (revision ``-``: none): for each, resolves
(and "downloads") the id with ``download_model``, then opens what the loader would load. Each
result names the files and the tensors, or the error's type and message.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any


def main() -> None:
    from vllm.config.load import LoadConfig

    import streamer
    from streamer_vllm.loader import StreamerModelLoader

    download_dir, wanted = sys.argv[1], sys.argv[2:]
    loader = StreamerModelLoader(LoadConfig(load_format="streamer", download_dir=download_dir))
    results: list[dict[str, Any]] = []
    for model_at_revision in wanted:
        model, revision = model_at_revision.rsplit("@", 1)
        # The fields of vLLM's ModelConfig that a loader reads to find the weights.
        at = None if revision == "-" else revision
        model_config = SimpleNamespace(model=model, revision=at, model_weights="")
        try:
            loader.download_model(model_config)
            with streamer.open(loader._source(model_config)) as handle:
                results.append({"files": list(handle.files), "tensors": handle.keys()})
        except Exception as exc:
            results.append({"error": type(exc).__name__, "message": str(exc)})
    print("RESULT " + json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    main()
