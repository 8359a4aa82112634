"""Writes MODEL as vLLM's pre-sharded layout (``sharded_state``) at tensor-parallel size TP into OUT.

``python save_sharded.py MODEL OUT TP``: each rank saves its shard of the model's state with
vLLM's ``ShardedStateLoader.save_model`` (what ``save_sharded_state`` calls), taken from a model
the rank builds and loads again without ``process_weights_after_loading``: on the CPU that step
moves linear weights into packed kernels and out of the state dict, so ``save_sharded_state``
itself writes files that nothing (``sharded_state`` included) can load there. The model's other
files (config, tokenizer) are copied beside them. Prints ``RESULT {}``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from run_llm import KV_CACHE_BYTES


def save_unprocessed(worker: Any, out: str) -> None:
    """Runs in each worker (``collective_rpc``): its shard of freshly loaded weights, saved."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import DefaultModelLoader, ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = worker.vllm_config
    dtype = set_default_torch_dtype(config.model_config.dtype)
    with set_current_vllm_config(config), dtype, torch.device("cpu"):
        # A prefix of its own: the worker's model already holds the layer names
        model = initialize_model(vllm_config=config, prefix="unprocessed")
        DefaultModelLoader(config.load_config).load_weights(model, config.model_config)
    ShardedStateLoader.save_model(model, out)


def main() -> None:
    from vllm import LLM

    model, out, tp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(
        model=str(model), load_format="safetensors", tensor_parallel_size=tp, dtype="float32",
        max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=True, seed=0,
    )  # fmt: skip
    llm.collective_rpc(save_unprocessed, args=(str(out),))
    for path in model.iterdir():
        if path.suffix != ".safetensors" and not path.name.endswith(".safetensors.index.json"):
            shutil.copy(path, out / path.name)
    print("RESULT " + json.dumps({}), flush=True)


if __name__ == "__main__":  # vLLM spawns processes that import this module
    main()
