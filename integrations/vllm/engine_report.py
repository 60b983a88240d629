"""Log, once per process and outcome, which engine a uccl Buffer chose for each operation and why."""

import logging

from uccl_ep_plugin import engines

# A child of vLLM's "vllm" logger, so the lines use vLLM's handler, format and level.
logger = logging.getLogger("vllm.uccl_ep_plugin")
_reported = set()


def describe(buffer) -> str:
    """E.g. ``reference engine on cuda:0 (native for get_dispatch_layout; reference for combine, ... because ...)``."""
    reasons = buffer.engine_reasons
    by_reason = {}
    for operation, engine in sorted(buffer.engine_by_operation.items()):
        why = reasons.get(operation) if engine == "reference" else None
        if engine == "reference" and why is None:
            why = f"{engines.ENGINE_ENV}={engines.requested_mode()}"
        by_reason.setdefault((engine, why), []).append(operation)
    parts = []
    for (engine, why), operations in by_reason.items():
        parts.append(f"{engine} for {', '.join(operations)}" + (f" because {why}" if why else ""))
    return f"{buffer.engine} engine on {buffer.device} ({'; '.join(parts)})"


def report(buffer, backend: str) -> None:
    line = f"uccl_ep_plugin: --all2all-backend {backend}: Buffer uses the {describe(buffer)}"
    if line not in _reported:
        _reported.add(line)
        logger.info(line)
