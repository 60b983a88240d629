"""Per-platform UCCL-EP settings: YAML files layered with environment and arguments.

Use :func:`resolve_config` to get the effective settings and where each came from::

    from uccl_ep_plugin.platform_config import resolve_config
    cfg = resolve_config()              # auto-detects the NIC platform
    cfg.values["UCCL_IB_SL"], cfg.sources["UCCL_IB_SL"]
    os.environ.update(cfg.as_environ())

Modules: ``schema`` (keys, types, validation, :class:`ConfigError`), ``detect``
(NIC platform from sysfs), ``loader`` (file lookup and layering).
"""

from .detect import PLATFORM_PRIORITY, detect_platform, detect_rdma_devices, detected_platforms
from .loader import (CONFIG_ENV_VAR, ResolvedConfig, available_platforms, config_dir,
                     load_file, resolve_config)
from .schema import SCHEMA, ConfigError, KeySpec

__all__ = [
    "CONFIG_ENV_VAR", "ConfigError", "KeySpec", "PLATFORM_PRIORITY", "ResolvedConfig",
    "SCHEMA", "available_platforms", "config_dir", "detect_platform", "detect_rdma_devices",
    "detected_platforms", "load_file", "resolve_config",
]
