"""Greedy generation with vLLM's ``LLM`` in this process tree; prints ``RESULT {json}`` on success.

``python run_llm.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON [LLM_KWARGS_JSON]]``. Small settings for
a tiny model on a 2-core CPU: eager mode (no compilation), a short context and a KV cache of a
fixed size (vLLM's default sizes it from the memory other processes leave free, and aborts on a
busy machine). ``LLM_KWARGS_JSON`` overrides or adds ``LLM`` arguments (revision, TP size...).
"""

from __future__ import annotations

import json
import sys

PROMPTS = ["the model loads", "vllm serves language"]
MAX_TOKENS = 12
KV_CACHE_BYTES = 64 << 20  # far more than 4 sequences of 128 tokens of the tiny model need


def main() -> None:
    from vllm import LLM, SamplingParams

    model, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    overrides = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
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
    llm = LLM(**(kwargs | overrides))
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "text": [o.outputs[0].text for o in outputs],
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM spawns processes that import this module
    main()
