"""SGLang plugin of uccl_ep_plugin: ``--moe-a2a-backend uccl``.

Installed as ``uccl_ep_plugin.integrations.sglang``; SGLang finds ``register`` through the
entry point ``uccl`` of the group ``sglang.srt.plugins`` (pyproject.toml) and calls it in
every process it starts (launcher, schedulers, detokenizer). ``SGLANG_PLUGINS=uccl``
restricts SGLang to this plugin.

``register`` checks the SGLang version and every hook point (``hook_points``), then
registers the hooks with SGLang's ``HookRegistry``; SGLang's loader applies them. The
result: ``uccl`` is a choice of ``--moe-a2a-backend``, SGLang runs its DeepEP path for it
(``--deepep-mode`` and ``--deepep-config`` as usual) with ``uccl_ep_plugin.Buffer`` and
``Config``, and ``--uccl-ep-config`` / ``UCCL_EP_CONFIG`` pick the platform config.

SGLang's loader logs an exception raised by a plugin and goes on; a drift error raised here
therefore appears in the log, and ``--moe-a2a-backend uccl`` is then refused by the parser.
"""

from .hook_points import (SUPPORTED_SGLANG_VERSIONS, SglangCompatibilityError, SglangHookPointMissing,
                          UnsupportedSglangVersion, check_sglang_compatibility, register_hooks)
from .selection import BACKEND_NAME, logger

__all__ = ["register", "BACKEND_NAME", "SUPPORTED_SGLANG_VERSIONS", "SglangCompatibilityError",
           "SglangHookPointMissing", "UnsupportedSglangVersion"]

_registered = False


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group."""
    global _registered
    if _registered:
        return
    version = check_sglang_compatibility()
    register_hooks()
    _registered = True
    logger().debug("uccl: plugin registered for sglang %s", version)
