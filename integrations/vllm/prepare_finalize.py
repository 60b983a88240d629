"""vLLM's DeepEP prepare/finalize classes bound to ``uccl_ep_plugin`` (Standard and BatchedExperts formats).

vLLM's ``deepep_ht``/``deepep_ll`` modules are loaded a second time with ``deep_ep`` meaning
uccl_ep_plugin (deep_ep_names.load_bound_module); the classes here subclass those copies
without changing them, so logs and isinstance checks name uccl. ``activate`` points the names
that ``maybe_make_prepare_finalize`` and ``maybe_roundup_layer_hidden_size`` read at call time
to these classes; it runs in a process once it builds a uccl all2all manager. Both classes write
their Buffer's traffic counters after each finalize when UCCL_EP_TRAFFIC_DIR is set (traffic_export).
"""

from functools import lru_cache

from . import traffic_export
from .backends import UCCL_HIGH_THROUGHPUT, UCCL_LOW_LATENCY

HT_MODULE = "vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht"
LL_MODULE = "vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll"
FACTORY_MODULE = "vllm.model_executor.layers.fused_moe.all2all_utils"
#: Globals of FACTORY_MODULE that its DeepEP branches read.
FACTORY_NAMES = ("DeepEPHTPrepareAndFinalize", "DeepEPLLPrepareAndFinalize", "DEEPEP_QUANT_BLOCK_SHAPE")


class _RecordsTraffic:
    """After each finalize (the combine of one MoE layer's forward), the Buffer's counters go to
    UCCL_EP_TRAFFIC_DIR when it is set (traffic_export)."""

    backend = ""

    def finalize(self, *args, **kwargs):
        result = super().finalize(*args, **kwargs)
        traffic_export.record(self.buffer, self.backend)
        return result

    def finalize_async(self, *args, **kwargs):
        result = super().finalize_async(*args, **kwargs)
        traffic_export.record(self.buffer, self.backend)
        return result


@lru_cache(maxsize=None)
def bound_names():
    """``{global name in the factory module: uccl-backed value}``."""
    from .deep_ep_names import load_bound_module

    ht = load_bound_module(HT_MODULE)
    ll = load_bound_module(LL_MODULE)

    class UcclHTPrepareAndFinalize(_RecordsTraffic, ht.DeepEPHTPrepareAndFinalize):
        """vLLM's DeepEP high-throughput prepare/finalize (Standard format) over uccl_ep_plugin.Buffer."""

        backend = UCCL_HIGH_THROUGHPUT

    class UcclLLPrepareAndFinalize(_RecordsTraffic, ll.DeepEPLLPrepareAndFinalize):
        """vLLM's DeepEP low-latency prepare/finalize (BatchedExperts format) over uccl_ep_plugin.Buffer."""

        backend = UCCL_LOW_LATENCY

    for klass in (UcclHTPrepareAndFinalize, UcclLLPrepareAndFinalize):
        klass.__module__ = __name__
    return {
        "DeepEPHTPrepareAndFinalize": UcclHTPrepareAndFinalize,
        "DeepEPLLPrepareAndFinalize": UcclLLPrepareAndFinalize,
        "DEEPEP_QUANT_BLOCK_SHAPE": ll.DEEPEP_QUANT_BLOCK_SHAPE,
    }


def activate() -> None:
    """Make vLLM's prepare/finalize factory build the uccl classes in this process."""
    import importlib

    factory = importlib.import_module(FACTORY_MODULE)
    for name, value in bound_names().items():
        setattr(factory, name, value)
