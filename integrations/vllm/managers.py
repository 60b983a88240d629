"""vLLM's DeepEP all2all managers with ``uccl_ep_plugin.Buffer`` as their buffer.

The subclasses keep vLLM's buffer sizing, caching and teardown: the methods that say
``import deep_ep`` are vLLM's own code run with ``deep_ep`` meaning uccl_ep_plugin
(see deep_ep_names). ``_UcclDeepEPBase`` sits between vLLM's HT/LL manager and
``DeepEPAll2AllManagerBase`` in the MRO, so the base initialiser runs with its
"is DeepEP installed" check answered for uccl_ep_plugin.
"""

import contextlib
import os
from functools import lru_cache

from uccl_ep_plugin.buffer import DEVICE_ENV

from . import engine_report, traffic_export
from .backends import UCCL_HIGH_THROUGHPUT, UCCL_LOW_LATENCY
from .deep_ep_names import rebind


@contextlib.contextmanager
def buffer_device_follows_vllm():
    """vLLM hands the manager its gloo ``cpu_group`` but CUDA tensors: on a CUDA-like platform the
    Buffer must run on the current GPU (staging through the host on that group), so
    ``UCCL_EP_DEVICE=cuda`` while the Buffer is built, unless the user set it."""
    from vllm.platforms import current_platform

    if DEVICE_ENV in os.environ or not current_platform.is_cuda_alike():
        yield
        return
    os.environ[DEVICE_ENV] = "cuda"
    try:
        yield
    finally:
        os.environ.pop(DEVICE_ENV, None)


def _with_uccl_buffer(vllm_get_handle, backend):
    handle_with_uccl = rebind(vllm_get_handle)

    def get_handle(self, kwargs):
        with buffer_device_follows_vllm(), traffic_export.counters_for_new_buffers():
            buffer = handle_with_uccl(self, kwargs)
        engine_report.report(buffer, backend)
        return buffer

    get_handle.__doc__ = f"vLLM's get_handle building a uccl_ep_plugin.Buffer ({backend})."
    return get_handle


@lru_cache(maxsize=None)
def manager_classes():
    """``{backend: manager class}``; built on first use because it imports vLLM's all2all module."""
    from vllm.distributed.device_communicators import all2all

    class _UcclDeepEPBase(all2all.DeepEPAll2AllManagerBase):
        __init__ = rebind(all2all.DeepEPAll2AllManagerBase.__init__, has_deep_ep=lambda: True)

    class UcclHTAll2AllManager(all2all.DeepEPHTAll2AllManager, _UcclDeepEPBase):
        """vLLM's DeepEP high-throughput manager over uccl_ep_plugin.Buffer."""

        get_handle = _with_uccl_buffer(all2all.DeepEPHTAll2AllManager.get_handle, UCCL_HIGH_THROUGHPUT)
        set_num_sms = rebind(all2all.DeepEPHTAll2AllManager.set_num_sms)

    class UcclLLAll2AllManager(all2all.DeepEPLLAll2AllManager, _UcclDeepEPBase):
        """vLLM's DeepEP low-latency manager over uccl_ep_plugin.Buffer."""

        _make_all2all_kwargs = rebind(all2all.DeepEPLLAll2AllManager._make_all2all_kwargs)
        get_handle = _with_uccl_buffer(all2all.DeepEPLLAll2AllManager.get_handle, UCCL_LOW_LATENCY)

    for klass in (_UcclDeepEPBase, UcclHTAll2AllManager, UcclLLAll2AllManager):
        klass.__module__ = __name__
    return {UCCL_HIGH_THROUGHPUT: UcclHTAll2AllManager, UCCL_LOW_LATENCY: UcclLLAll2AllManager}


def make_manager(backend: str, cpu_group, tcp_store_group=None):
    return manager_classes()[backend](cpu_group, tcp_store_group)
