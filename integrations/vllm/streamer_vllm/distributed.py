"""The process group a vLLM worker loads with: its tensor-parallel group, when there is one.

vLLM starts one worker per TP rank and each calls the loader for the whole checkpoint; loading
through the TP group vLLM already built makes each rank read about ``1/TP`` of the bytes and
receive the rest (``streamer.group``). vLLM is imported only when asked, so importing the plugin
still imports no vLLM.
"""

from __future__ import annotations

import torch.distributed as dist


def loading_group(enabled: bool, device: str) -> dist.ProcessGroup | None:
    """The TP group's CPU (gloo) group for CPU weights, its device (NCCL) group for GPU weights;
    ``None`` when turned off (``"distributed": false``) or when there is no TP group of 2 or more."""
    if not enabled or tensor_parallel_size() < 2:
        return None
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tp_group()
    group: dist.ProcessGroup = tp.device_group if device.startswith("cuda") else tp.cpu_group
    return group


def tensor_parallel_size() -> int:
    """vLLM's tensor-parallel size in this process (1 before its groups exist)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    size: int = parallel_state.get_tp_group().world_size
    return size
