"""Which vLLM releases the plugin supports, and the patch module for each."""

import importlib
import os
import re
from types import ModuleType
from typing import Dict

from .patch_points import VllmPatchError

#: vLLM release -> module (in this package) holding its patch points.
SUPPORTED: Dict[str, str] = {
    "0.33.0": "patches_0_33",
}
#: Set to 1 to try the newest patch module on an untested vLLM release (patch points are still checked).
ALLOW_UNTESTED_ENV = "UCCL_EP_VLLM_ALLOW_UNTESTED"


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def release(version: str) -> str:
    """``0.33.0`` from ``0.33.0+cpu`` or ``0.33.0rc1.dev5+g1234``."""
    match = re.match(r"\d+(\.\d+)*", version)
    return match.group(0) if match else version


def patch_module(version: str) -> ModuleType:
    name = SUPPORTED.get(release(version))
    if name is None:
        if os.environ.get(ALLOW_UNTESTED_ENV, "").strip() not in ("1", "true", "yes"):
            raise VllmPatchError(
                f"uccl vLLM plugin: vLLM {version} is not supported; supported versions: "
                f"{', '.join(sorted(SUPPORTED))} (set {ALLOW_UNTESTED_ENV}=1 to try the patches of "
                f"{max(SUPPORTED)} anyway)")
        name = SUPPORTED[max(SUPPORTED)]
    return importlib.import_module(f"{__package__}.{name}")
