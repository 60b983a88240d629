"""Choosing and checking the UCCL-EP platform config when SGLang starts with ``uccl``.

The config comes from ``--uccl-ep-config NAME_OR_PATH`` (added to SGLang's parser by this
plugin) or else from the ``UCCL_EP_CONFIG`` environment variable, then layered by
``uccl_ep_plugin.platform_config.resolve_config``. A bad file or value raises
``ConfigError`` naming the file and key, which stops SGLang's start-up because it is
raised while SGLang resolves its server arguments.
"""

import os

from uccl_ep_plugin.platform_config import CONFIG_ENV_VAR, ConfigError, resolve_config

from .selection import logger

FLAG = "--uccl-ep-config"


def resolve_platform_config(chosen=None):
    """Resolve the platform config; ``chosen`` is the value of ``--uccl-ep-config`` or None.

    With a flag value, ``UCCL_EP_CONFIG`` is set to it, so that processes SGLang starts
    later (schedulers) and the Buffer itself resolve the same file.
    """
    source = FLAG if chosen else (CONFIG_ENV_VAR if os.environ.get(CONFIG_ENV_VAR, "").strip() else None)
    try:
        resolved = resolve_config(config_file=chosen) if chosen else resolve_config()
    except ConfigError as exc:
        where = f" (chosen by {source})" if source else ""
        raise ConfigError(f"uccl_ep_plugin: the UCCL-EP platform config{where} is invalid: {exc}") from exc
    if chosen:
        os.environ[CONFIG_ENV_VAR] = chosen
    logger().info("uccl: UCCL-EP platform config: platform=%s, files=%s%s", resolved.platform,
                  ", ".join(resolved.files), f" (chosen by {source})" if source else "")
    return resolved
