"""Expert parallelism: which expert weights this rank owns, so that the others are never read.

With ``--enable-expert-parallel`` each rank's MoE layers hold only its own experts, and their
weight loaders drop every other expert's tensors; those are ~85-90% of an MoE checkpoint's
bytes. vLLM's default loader skips them before reading only under ``enable_ep_weight_filter``
(off by default in vLLM 0.32); this load format skips them whenever expert parallelism is on and
expert-parallel load balancing (EPLB: redundant experts that may copy any expert) is off, since
reading bytes the model then drops is pure waste. ``ep_weight_filter: false`` turns it off.

Which experts and which tensors are vLLM's own rules (``ep_weight_filter.py``): the rank and
size computed as ``FusedMoEParallelConfig`` does, the experts placed as configured, and only
per-expert ``.weight`` tensors skipped (scales stay: some backends need every expert's).
Imports vLLM: used only by the loader.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.config import ModelConfig, ParallelConfig, get_current_vllm_config
from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids, should_skip_weight

NameFilter = Callable[[str], bool]


def local_experts_only(model_config: ModelConfig) -> NameFilter | None:
    """A test that a checkpoint name passes unless it is another rank's expert weight; ``None``
    when this rank loads every expert (no expert parallelism, EPLB, or a dense model)."""
    if not model_config.is_moe:
        return None
    parallel = get_current_vllm_config().parallel_config
    if not parallel.enable_expert_parallel or parallel.enable_eplb:
        return None
    num_experts = model_config.get_num_experts()
    if num_experts <= 0:
        return None
    size, rank = _expert_parallel_rank(parallel)
    local = compute_local_expert_ids(num_experts, size, rank, placement=parallel.expert_placement_strategy)
    if local is None:
        return None
    return lambda name: not should_skip_weight(name, local)


def _expert_parallel_rank(parallel: ParallelConfig) -> tuple[int, int]:
    """(size, rank) of this worker among the expert-parallel ranks: the data-, context- and
    tensor-parallel ranks flattened, as vLLM's ``FusedMoEParallelConfig.make`` does."""
    from vllm.distributed import get_dp_group, get_pcp_group, get_tensor_model_parallel_rank

    dp_size = parallel.data_parallel_size
    tp_size = parallel.tensor_parallel_size
    pcp_size = parallel.prefill_context_parallel_size
    dp_rank = get_dp_group().rank_in_group if dp_size > 1 else 0
    tp_rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
    pcp_rank = get_pcp_group().rank_in_group if pcp_size > 1 else 0
    return dp_size * pcp_size * tp_size, dp_rank * pcp_size * tp_size + pcp_rank * tp_size + tp_rank
