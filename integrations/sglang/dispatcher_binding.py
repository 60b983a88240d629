"""Pointing SGLang's DeepEP dispatcher at ``uccl_ep_plugin.Buffer`` and ``Config``.

``sglang/srt/layers/moe/token_dispatcher/deepep.py`` reads the module globals ``Buffer``
and ``Config`` (bound by its ``from deep_ep import Buffer, Config``) when it sizes and
builds its buffer, builds ``Config`` objects from ``--deepep-config`` and captures events;
it refuses to run when the global ``use_deepep`` is False (``deep_ep`` failed to import).
When the published ServerArgs chose ``uccl``, ``bind_uccl_classes`` rebinds those four
globals of that one module. The ``deep_ep`` module (owned by ``sgl-deep-ep``) is never
touched or shadowed, and with ``--moe-a2a-backend deepep`` nothing is rebound.

* ``bind_after_moe_config`` (AFTER ``initialize_moe_config``): runs once per scheduler
  process, after SGLang published its arguments and before any model layer is built.
* ``log_engine_choice`` (AFTER ``DeepEPBuffer.get_deepep_buffer``): logs which engine the
  new Buffer chose for each operation, and why.
"""

import importlib

import uccl_ep_plugin

from .selection import logger, published_record_selects_uccl

DEEPEP_DISPATCHER_MODULE = "sglang.srt.layers.moe.token_dispatcher.deepep"
FP8_QUANT_MODULE = "sglang.kernels.ops.quantization.fp8_kernel"
FP8_QUANT_NAME = "sglang_per_token_group_quant_fp8"

_logged_buffers = set()


def dispatcher_module():
    return importlib.import_module(DEEPEP_DISPATCHER_MODULE)


def bind_uccl_classes() -> None:
    """Rebind ``Buffer``/``Config`` (and the availability flag) in SGLang's DeepEP dispatcher module."""
    module = dispatcher_module()
    if getattr(module, "Buffer", None) is uccl_ep_plugin.Buffer and module.use_deepep:
        return
    module.Buffer = uccl_ep_plugin.Buffer
    module.Config = uccl_ep_plugin.Config
    module.use_deepep = True
    module._deepep_import_error = None
    # The fp8 quantizer is imported in the same try block as deep_ep, so it is missing
    # when deep_ep is not installed; it is only called for fp8 dispatch with DeepGEMM.
    if not hasattr(module, FP8_QUANT_NAME) and not getattr(module, "_is_npu", False):
        try:
            setattr(module, FP8_QUANT_NAME, getattr(importlib.import_module(FP8_QUANT_MODULE), FP8_QUANT_NAME))
        except Exception as exc:  # only needed on GPUs with DeepGEMM
            logger().debug("uccl: %s unavailable (%s); fp8 normal-mode dispatch needs it", FP8_QUANT_NAME, exc)
    logger().info("uccl: SGLang's DeepEP dispatcher (%s) now uses uccl_ep_plugin.Buffer and "
                  "uccl_ep_plugin.Config (uccl_ep_plugin %s)", DEEPEP_DISPATCHER_MODULE, uccl_ep_plugin.__version__)


def bind_after_moe_config(result, *args, **kwargs):
    """AFTER hook of ``sglang.srt.layers.moe.utils.initialize_moe_config()``."""
    if published_record_selects_uccl():
        bind_uccl_classes()
    return None


def describe_engine_choice(buffer) -> str:
    reasons = getattr(buffer, "engine_reasons", {}) or {}
    by_operation = getattr(buffer, "engine_by_operation", {}) or {}
    parts = []
    for operation, engine in by_operation.items():
        why = reasons.get(operation)
        parts.append(f"{operation}={engine}" + (f" ({why})" if why and engine == "reference" else ""))
    return f"engine={getattr(buffer, 'engine', '?')}; " + "; ".join(parts)


def log_engine_choice(buffer, *args, **kwargs):
    """AFTER hook of the classmethod ``DeepEPBuffer.get_deepep_buffer(...)``."""
    if isinstance(buffer, uccl_ep_plugin.Buffer) and id(buffer) not in _logged_buffers:
        _logged_buffers.add(id(buffer))
        logger().info("uccl: rank %d/%d Buffer (low_latency_mode=%s, nvl=%d B, rdma=%d B, device=%s): %s",
                      buffer.rank, buffer.group_size, buffer.low_latency_mode, buffer.num_nvl_bytes,
                      buffer.num_rdma_bytes, buffer.device, describe_engine_choice(buffer))
    return None
