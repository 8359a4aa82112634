"""Greedy generation with vLLM's ``LLM`` in this process tree; prints ``RESULT {json}`` on success.

``python run_llm.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON]``. Small settings for a tiny model on
a 2-core CPU: eager mode (no compilation), a small KV cache, a short context.
"""

from __future__ import annotations

import json
import sys

PROMPTS = ["the model loads", "vllm serves language"]
MAX_TOKENS = 12


def main() -> None:
    from vllm import LLM, SamplingParams

    model, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=extra,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        gpu_memory_utilization=0.05,  # on the CPU: the share of RAM for the KV cache
        enforce_eager=True,
        seed=0,
    )
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "text": [o.outputs[0].text for o in outputs],
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM spawns processes that import this module
    main()
