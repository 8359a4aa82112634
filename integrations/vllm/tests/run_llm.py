"""Greedy generation with vLLM's ``LLM`` in this process tree; prints ``RESULT {json}`` on success.

``python run_llm.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON [LLM_KWARGS_JSON [RELOADS_JSON]]]``.
Small settings for a tiny model on a 2-core CPU: eager mode (no compilation), a short context
and a KV cache of a fixed size (vLLM's default sizes it from the memory other processes leave
free, and aborts on a busy machine). ``LLM_KWARGS_JSON`` overrides or adds ``LLM`` arguments
(revision, TP size...).
``RELOADS_JSON``: a list of in-place reloads (vLLM's ``reload_weights``) after the first
generation, each a ``weights_path`` or null (the model's own); after each, the same generation,
its seconds and this process's resident memory, threads and descriptors (the engine runs in this
process unless multiprocessing is on).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PROMPTS = ["the model loads", "vllm serves language"]
MAX_TOKENS = 12
KV_CACHE_BYTES = 64 << 20  # far more than 4 sequences of 128 tokens of the tiny model need


def llm_arguments(argv: list[str]) -> dict[str, Any]:
    """``LLM``'s arguments from ``MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON [LLM_KWARGS_JSON]]``."""
    model, load_format = argv[0], argv[1]
    extra = json.loads(argv[2]) if len(argv) > 2 else {}
    overrides = json.loads(argv[3]) if len(argv) > 3 else {}
    kwargs = {
        "model": model,
        "load_format": load_format,
        "model_loader_extra_config": extra,
        "dtype": "float32",
        "max_model_len": 128,
        "max_num_seqs": 4,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "enforce_eager": True,
        "seed": 0,
    }
    return kwargs | overrides


def main() -> None:
    from vllm import LLM, SamplingParams

    reloads = json.loads(sys.argv[5]) if len(sys.argv) > 5 else []
    llm = LLM(**llm_arguments(sys.argv[1:]))
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, sampling)
    result: dict[str, Any] = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "text": [o.outputs[0].text for o in outputs],
        "reloads": [],
    }
    for weights_path in reloads:
        started = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path} if weights_path else {})
        seconds = time.perf_counter() - started
        outputs = llm.generate(PROMPTS, sampling)
        result["reloads"].append(
            {
                "weights_path": weights_path,
                "seconds": seconds,
                "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                **_resources(),
            }
        )
    print("RESULT " + json.dumps(result), flush=True)


def _resources() -> dict[str, int]:
    """This process's resident bytes, threads and open descriptors."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    threads, fds = len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))
    return {"rss": rss, "threads": threads, "fds": fds}


if __name__ == "__main__":  # vLLM spawns processes that import this module
    main()
