"""Every place in SGLang this plugin hooks or relies on, with the reason, and the drift check.

All hooks go through SGLang's own ``HookRegistry`` (``sglang.srt.plugins.hook_registry``).
``check_sglang_compatibility`` runs before anything is registered: it checks the installed
SGLang version and resolves every dotted path below, and raises ``SglangHookPointMissing``
(naming the path) or ``UnsupportedSglangVersion`` so nothing is half-installed.
"""

import importlib
import inspect
import os
import pkgutil
from dataclasses import dataclass
from typing import Callable, Optional

from . import backend_option, dispatcher_binding

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
# Set to 1 to try an SGLang release not listed above (every hook point is still checked).
ALLOW_UNTESTED_ENV = "UCCL_EP_SGLANG_ALLOW_UNTESTED"

_DEEPEP = dispatcher_binding.DEEPEP_DISPATCHER_MODULE


@dataclass(frozen=True)
class HookPoint:
    #: Dotted path of the function, method, class attribute or module global.
    path: str
    #: Why the plugin needs it.
    reason: str
    #: "AFTER", "BEFORE" or "AROUND" (a HookRegistry hook), or "rebinds"/"relies on".
    how: str
    #: The hook function, for registry hooks.
    handler: Optional[Callable] = None
    #: For module globals that may be absent (``Buffer`` without deep_ep): a function whose
    #: code must still read the global by this name.
    read_by: Optional[str] = None


HOOK_POINTS = (
    HookPoint("sglang.srt.server_args.ServerArgs.add_cli_args",
              "SGLang's parser: add 'uccl' to --moe-a2a-backend's choices and add --uccl-ep-config",
              "AFTER", backend_option.add_uccl_to_parser),
    HookPoint("sglang.srt.server_args.ServerArgs.from_cli_args",
              "keep the parsed --uccl-ep-config on the ServerArgs record (it is not a field)",
              "AFTER", backend_option.carry_config_flag),
    HookPoint("sglang.srt.server_args.ServerArgs.resolve_once",
              "before SGLang resolves its arguments: check the UCCL-EP platform config, rewrite "
              "moe_a2a_backend uccl -> deepep and mark the record, so every backend branch takes DeepEP's",
              "BEFORE", backend_option.select_deepep_path_for_uccl),
    HookPoint("sglang.srt.layers.moe.utils.MoeA2ABackend._missing_",
              "MoeA2ABackend('uccl') converts to MoeA2ABackend.DEEPEP",
              "AROUND", backend_option.accept_uccl_in_enum),
    HookPoint("sglang.srt.layers.moe.utils.initialize_moe_config",
              "once per scheduler process, after publish and before model layers are built: rebind "
              "Buffer/Config in the DeepEP dispatcher module when the record chose uccl",
              "AFTER", dispatcher_binding.bind_after_moe_config),
    HookPoint(f"{_DEEPEP}.DeepEPBuffer.get_deepep_buffer",
              "log the engine (native/reference) each operation of the new Buffer uses, and why",
              "AFTER", dispatcher_binding.log_engine_choice),
    HookPoint(f"{_DEEPEP}.Buffer",
              "the dispatcher builds and sizes its buffer from this module global (from deep_ep)",
              "rebinds", read_by=f"{_DEEPEP}.DeepEPBuffer.get_deepep_buffer"),
    HookPoint(f"{_DEEPEP}.Config",
              "the dispatcher builds --deepep-config's Config objects from this module global",
              "rebinds", read_by=f"{_DEEPEP}.DeepEPConfig.__init__"),
    HookPoint(f"{_DEEPEP}.use_deepep",
              "the dispatcher refuses to start when deep_ep failed to import",
              "rebinds", read_by=f"{_DEEPEP}._DeepEPDispatcherImplBase.__init__"),
    HookPoint(f"{_DEEPEP}._deepep_import_error",
              "reset together with use_deepep", "rebinds"),
    HookPoint("sglang.srt.runtime_context.get_server_args",
              "read the published ServerArgs record in scheduler processes", "relies on"),
    HookPoint("sglang.srt.server_args.ServerArgs.__reduce__",
              "pickles the record's bookkeeping (our uccl mark) to spawned processes", "relies on"),
    HookPoint("sglang.srt.plugins.hook_registry.HookRegistry.register",
              "SGLang's hook registry, used for every hook above", "relies on"),
)

REGISTRY_HOOK_TYPES = ("AFTER", "BEFORE", "AROUND")


class SglangCompatibilityError(RuntimeError):
    """The installed SGLang does not match what this plugin was written against."""


class UnsupportedSglangVersion(SglangCompatibilityError):
    pass


class SglangHookPointMissing(SglangCompatibilityError):
    pass


def installed_sglang_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _supported() -> str:
    return ", ".join(SUPPORTED_SGLANG_VERSIONS)


def _resolve(path: str):
    return pkgutil.resolve_name(path)


def _missing(point: HookPoint, version: Optional[str], detail: str) -> SglangHookPointMissing:
    return SglangHookPointMissing(
        f"uccl_ep_plugin: SGLang hook point '{point.path}' is missing ({detail}) in sglang {version}; "
        f"the uccl plugin needs it to {point.reason}. Supported sglang versions: {_supported()}.")


def check_hook_point(point: HookPoint, version: Optional[str]) -> None:
    if point.read_by is not None:
        try:
            reader = _resolve(point.read_by)
        except (ImportError, AttributeError, ValueError) as exc:
            raise _missing(point, version, f"{point.read_by} not found: {exc}") from exc
        name = point.path.rsplit(".", 1)[1]
        # Look through HookRegistry wrappers (they keep the original in __wrapped__).
        code = getattr(inspect.unwrap(getattr(reader, "__func__", reader)), "__code__", None)
        if code is None or name not in code.co_names:
            raise _missing(point, version, f"{point.read_by} no longer reads the global {name!r}")
        return
    module_path, _, attr = point.path.rpartition(".")
    try:
        owner = _resolve(module_path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise _missing(point, version, f"{module_path} not found: {exc}") from exc
    # A class must define the attribute itself: one inherited from a base (Enum._missing_)
    # is not the hook point this plugin was written against.
    present = attr in vars(owner) if isinstance(owner, type) else hasattr(owner, attr)
    if not present:
        raise _missing(point, version, f"{module_path} has no attribute {attr!r}")


def check_sglang_compatibility() -> str:
    """Raise unless the installed SGLang is supported and has every hook point; returns its version."""
    version = installed_sglang_version()
    if version is None:
        raise UnsupportedSglangVersion("uccl_ep_plugin: sglang is not installed; supported versions: "
                                       f"{_supported()}")
    if version not in SUPPORTED_SGLANG_VERSIONS and os.environ.get(ALLOW_UNTESTED_ENV, "") != "1":
        raise UnsupportedSglangVersion(
            f"uccl_ep_plugin: sglang {version} is not supported by the uccl plugin; supported versions: "
            f"{_supported()} (set {ALLOW_UNTESTED_ENV}=1 to try anyway; every hook point is still checked)")
    importlib.import_module(_DEEPEP)  # a failure here names the module in its traceback
    for point in HOOK_POINTS:
        check_hook_point(point, version)
    return version


def register_hooks() -> None:
    """Register every registry hook with SGLang's HookRegistry (applied by SGLang's loader)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for point in HOOK_POINTS:
        if point.how in REGISTRY_HOOK_TYPES:
            HookRegistry.register(point.path, point.handler, HookType[point.how])
