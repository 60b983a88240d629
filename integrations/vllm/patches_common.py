"""Patch points and appliers shared by every supported vLLM version.

Each ``patches_<version>.py`` lists :func:`common_points` plus the points of its own release and
platform (the device communicator that builds the all2all manager, platform workarounds). vLLM has
no registry for all2all backends, so each change is the smallest one that makes vLLM's own code
paths (CLI, config validation, communicator, prepare/finalize factory) accept and build the uccl
backends. Changes only act when a uccl backend is selected; every other backend sees vLLM unchanged.
"""

import functools
import inspect
import logging
import typing
from typing import List, Mapping, Optional

from . import backends
from .backends import DeepEPView, is_uccl, twin
from .patch_points import PatchPoint, VllmPatchError, is_class, is_property, reads_globals

logger = logging.getLogger("vllm.uccl_ep_plugin")
#: Set on every function the plugin installed, so patching twice is a no-op.
PATCHED_MARK = "__uccl_ep_plugin_patched__"

PARALLEL = "vllm.config.parallel"
FUSED_MOE_CONFIG = "vllm.model_executor.layers.fused_moe.config"
COMPILATION = "vllm.config.compilation"
ALL2ALL = "vllm.distributed.device_communicators.all2all"
ALL2ALL_UTILS = "vllm.model_executor.layers.fused_moe.all2all_utils"


# ---------------------------------------------------------------- appliers
def extend_literal_field(owner, name) -> None:
    """Add the uccl names to a pydantic-dataclass field typed ``Literal[...]``.

    The CLI reads ``dataclasses.fields(ParallelConfig)[...].type`` for argparse choices and
    pydantic validates with the schema built from ``__pydantic_fields__``: both get the wider
    Literal, then the validator is rebuilt.
    """
    from pydantic.dataclasses import rebuild_dataclass

    field = owner.__dataclass_fields__[name]
    present = typing.get_args(field.type)
    if all(backend in present for backend in backends.UCCL_BACKENDS):
        return
    widened = typing.Literal[tuple(present) + backends.UCCL_BACKENDS]
    field.type = widened
    owner.__annotations__[name] = widened
    owner.__pydantic_fields__[name].annotation = widened
    rebuild_dataclass(owner, force=True)


def predicate_sees_twin(owner, name) -> None:
    """Evaluate vLLM's property on a view where a uccl backend reads as its DeepEP twin."""
    original = owner.__dict__[name]
    if getattr(original.fget, PATCHED_MARK, False):
        return

    @functools.wraps(original.fget)
    def fget(self):
        return original.fget(DeepEPView(self) if is_uccl(self.all2all_backend) else self)

    setattr(fget, PATCHED_MARK, True)
    setattr(owner, name, property(fget, original.fset, original.fdel, original.__doc__))


def replace_once(owner, name: str, make_replacement) -> None:
    """Sets ``owner.name`` to ``make_replacement(original)``, wrapped to look like the original and
    marked, so applying a patch twice changes nothing."""
    original = owner.__dict__[name]
    if getattr(original, PATCHED_MARK, False):
        return
    replacement = functools.wraps(original)(make_replacement(original))
    setattr(replacement, PATCHED_MARK, True)
    setattr(owner, name, replacement)


def splitting_ops_see_twin(owner, name) -> None:
    """``CompilationConfig.set_splitting_ops_for_v1(all2all_backend, data_parallel_size)`` decides
    CUDA graphs from the backend name: give it the twin, then turn CUDA graphs off while a uccl
    dispatch/combine runs on an engine that cannot be captured (the reference engine syncs the host)."""
    def replacement(original):
        signature = inspect.signature(original)

        def set_splitting_ops_for_v1(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            backend = bound.arguments.get("all2all_backend")
            if not is_uccl(backend):
                return original(self, *args, **kwargs)
            bound.arguments["all2all_backend"] = twin(backend)
            result = original(*bound.args, **bound.kwargs)
            bound.apply_defaults()
            _disable_cudagraphs_if_not_capturable(self, backend, bound.arguments.get("data_parallel_size", 1))
            return result
        return set_splitting_ops_for_v1

    replace_once(owner, name, replacement)


def _disable_cudagraphs_if_not_capturable(compilation_config, backend: str, data_parallel_size: int) -> None:
    from vllm.config.compilation import CUDAGraphMode

    from .capture import capture_blocker

    if data_parallel_size <= 1 or compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
        return
    blocker = capture_blocker(backend)
    if blocker is not None:
        logger.info("uccl_ep_plugin: disabling CUDA graphs for --all2all-backend %s: %s", backend, blocker)
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE


def communicator_builds_uccl_manager(owner, name, unsupported: Optional[Mapping[str, str]] = None) -> None:
    """A device communicator's ``__init__`` (CUDA's, or CPU's) picks the all2all manager by the backend
    name and rejects or replaces names it does not know. For a uccl backend it runs with
    ``use_all2all=False`` and the uccl manager is built afterwards (what the DeepEP branch of
    ``CudaCommunicator`` does, with our class). ``unsupported``: uccl backend -> why this platform
    cannot run it; the EP communicator then raises VllmPatchError instead of building a manager."""
    def replacement(original):
        signature = inspect.signature(original)

        def __init__(self, *args, **kwargs):
            from vllm.config import get_current_vllm_config_or_none

            config = get_current_vllm_config_or_none()
            backend = config.parallel_config.all2all_backend if config is not None else None
            if not is_uccl(backend):
                return original(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            wanted = bool(bound.arguments["use_all2all"])
            bound.arguments["use_all2all"] = False
            original(*bound.args, **bound.kwargs)
            # DeviceCommunicatorBase: all2all runs on the EP communicator only.
            self.use_all2all = self.is_ep_communicator and wanted
            if self.use_all2all:
                if unsupported and backend in unsupported:
                    raise VllmPatchError(f"uccl vLLM plugin: --all2all-backend {backend} cannot run on this "
                                         f"platform: {unsupported[backend]}")
                build_uccl_manager(self, backend, bound.arguments.get("tcp_store_group"))
        return __init__

    replace_once(owner, name, replacement)


def build_uccl_manager(communicator, backend: str, tcp_store_group=None) -> None:
    from .managers import make_manager
    from .prepare_finalize import activate

    activate()
    communicator.all2all_manager = make_manager(backend, communicator.cpu_group, tcp_store_group)
    logger.info("uccl_ep_plugin: using %s all2all manager (--all2all-backend %s)",
                type(communicator.all2all_manager).__name__, backend)


# ---------------------------------------------------------------- the shared points
def common_points() -> List[PatchPoint]:
    """Points every supported release shares: backend names, predicates, CUDA-graph decision,
    the DeepEP managers we subclass and the prepare/finalize factory whose globals we rebind."""
    return [
        PatchPoint(f"{PARALLEL}:ParallelConfig.__dataclass_fields__.all2all_backend",
                   "--all2all-backend choices and ParallelConfig validation come from this Literal field",
                   apply=lambda owner, name: extend_literal_field(_parallel_config(), "all2all_backend"),
                   expect=_is_literal_field),
        PatchPoint(f"{PARALLEL}:ParallelConfig.use_sequence_parallel_moe",
                   "lists DeepEP backends by name: uccl needs the same sequence-parallel MoE decision",
                   apply=predicate_sees_twin, expect=is_property),
        PatchPoint(f"{PARALLEL}:ParallelConfig.use_batched_dp_moe",
                   "lists deepep_low_latency by name: uccl_low_latency uses the same batched DP MoE path",
                   apply=predicate_sees_twin, expect=is_property),
        PatchPoint(f"{FUSED_MOE_CONFIG}:FusedMoEParallelConfig.use_deepep_ht_kernels",
                   "selects the Standard-format DeepEP HT path (hidden-size rounding, experts, prepare/finalize)",
                   apply=predicate_sees_twin, expect=is_property),
        PatchPoint(f"{FUSED_MOE_CONFIG}:FusedMoEParallelConfig.use_deepep_ll_kernels",
                   "selects the BatchedExperts-format DeepEP LL path (batched activations, routing tables)",
                   apply=predicate_sees_twin, expect=is_property),
        PatchPoint(f"{COMPILATION}:CompilationConfig.set_splitting_ops_for_v1",
                   "decides CUDA graphs from the backend name; the reference engine cannot be captured",
                   apply=splitting_ops_see_twin, expect=has_parameter("all2all_backend")),
        PatchPoint(f"{ALL2ALL}:DeepEPAll2AllManagerBase.__init__",
                   "subclassed: its DeepEP-installed check is answered for uccl_ep_plugin",
                   expect=reads_globals("has_deep_ep")),
        PatchPoint(f"{ALL2ALL}:DeepEPHTAll2AllManager", "subclassed: the uccl_high_throughput manager",
                   expect=class_with("get_handle", "set_num_sms", "_make_all2all_kwargs")),
        PatchPoint(f"{ALL2ALL}:DeepEPLLAll2AllManager", "subclassed: the uccl_low_latency manager",
                   expect=class_with("get_handle", "_make_all2all_kwargs")),
        PatchPoint(f"{ALL2ALL_UTILS}:maybe_make_prepare_finalize",
                   "builds DeepEP prepare/finalize from module globals, rebound to the uccl classes",
                   expect=reads_globals("DeepEPHTPrepareAndFinalize", "DeepEPLLPrepareAndFinalize",
                                        "DEEPEP_QUANT_BLOCK_SHAPE")),
        PatchPoint(f"{ALL2ALL_UTILS}:maybe_roundup_layer_hidden_size",
                   "rounds the hidden size through the same DeepEP classes",
                   expect=reads_globals("DeepEPHTPrepareAndFinalize", "DeepEPLLPrepareAndFinalize")),
    ]


#: vLLM modules run again with deep_ep bound to uccl_ep_plugin (they import deep_ep at top level,
#: so they are checked by source, not imported): module -> names that must be defined in it.
BOUND_MODULES = {
    "vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht": ("DeepEPHTPrepareAndFinalize",),
    "vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll": ("DeepEPLLPrepareAndFinalize",
                                                                        "DEEPEP_QUANT_BLOCK_SHAPE"),
}


def _parallel_config():
    from vllm.config.parallel import ParallelConfig
    return ParallelConfig


def _is_literal_field(value):
    field_type = getattr(value, "type", None)
    if typing.get_origin(field_type) is not typing.Literal:
        return f"expected a dataclass field typed Literal[...], found {field_type!r}"
    missing = [name for name in backends.DEEPEP_TWIN.values() if name not in typing.get_args(field_type)]
    return f"its Literal lacks {', '.join(missing)}" if missing else None


def has_parameter(parameter):
    """Expect a callable that takes ``parameter``."""
    def expect(value):
        try:
            parameters = inspect.signature(value).parameters
        except (TypeError, ValueError):
            return f"expected a function, found {type(value).__name__}"
        return None if parameter in parameters else f"it no longer takes {parameter!r}"
    return expect


def class_with(*methods):
    """Expect a class that has each of ``methods`` (own or inherited)."""
    def expect(value):
        problem = is_class(value)
        if problem:
            return problem
        missing = [m for m in methods if not hasattr(value, m)]
        return f"it lacks {', '.join(missing)}" if missing else None
    return expect
