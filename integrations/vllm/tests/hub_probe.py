"""Calls the plugin's loader directly, as vLLM would, for a model id; prints ``RESULT {json}``.

``python hub_probe.py MODEL_ID REVISION|- DOWNLOAD_DIR|-``: resolves (and "downloads") the
id with ``download_model``, then reads what the loader would load. The result names the files
and the tensors, or the error's type and message.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def main() -> None:
    from streamer_vllm.loader import StreamerModelLoader
    from vllm.config.load import LoadConfig

    import streamer

    model, revision, download_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    loader = StreamerModelLoader(
        LoadConfig(load_format="streamer", download_dir=None if download_dir == "-" else download_dir)
    )
    # The fields of vLLM's ModelConfig that a loader reads to find the weights.
    revision_or_none = None if revision == "-" else revision
    model_config = SimpleNamespace(model=model, revision=revision_or_none, model_weights="")
    try:
        loader.download_model(model_config)
        source = loader._source(model_config)
        with streamer.open(source) as handle:
            result = {"files": list(handle.files), "tensors": handle.keys()}
    except Exception as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
