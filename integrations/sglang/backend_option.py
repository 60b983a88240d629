"""Hooks that make ``--moe-a2a-backend uccl`` a valid choice and turn it into SGLang's DeepEP path.

* ``add_uccl_to_parser`` (AFTER ``ServerArgs.add_cli_args``): appends ``uccl`` to the
  choices of SGLang's ``--moe-a2a-backend`` argument and adds ``--uccl-ep-config``.
* ``carry_config_flag`` (AFTER ``ServerArgs.from_cli_args``): the parsed
  ``--uccl-ep-config`` is not a ServerArgs field, so it rides on the record as bookkeeping.
* ``select_deepep_path_for_uccl`` (BEFORE ``ServerArgs.resolve_once``): checks the UCCL-EP
  platform config, then rewrites ``moe_a2a_backend`` from ``uccl`` to ``deepep`` and marks the
  record, so every later branch in SGLang sees ``deepep``.
* ``accept_uccl_in_enum`` (AROUND ``MoeA2ABackend._missing_``): ``MoeA2ABackend("uccl")`` is
  ``MoeA2ABackend.DEEPEP``, for callers that convert a raw ``uccl`` string themselves.
"""

import argparse

from .platform_setup import FLAG as CONFIG_FLAG
from .platform_setup import resolve_platform_config
from .selection import BACKEND_NAME, CONFIG_CHOICE_ATTR, DEEPEP_BACKEND_NAME, SELECTED_ATTR, logger

BACKEND_FLAG = "--moe-a2a-backend"
CONFIG_DEST = "uccl_ep_config"


class ParserLayoutChanged(RuntimeError):
    """SGLang's parser no longer has the argument this plugin extends."""


def _find_action(parser: argparse.ArgumentParser, option: str) -> argparse.Action:
    for action in parser._actions:
        if option in action.option_strings:
            return action
    raise ParserLayoutChanged(f"uccl_ep_plugin: SGLang's argument parser has no {option} option; "
                              "this SGLang version is not supported by the uccl plugin")


def add_uccl_to_parser(result, parser, *args, **kwargs):
    """AFTER hook of ``ServerArgs.add_cli_args(parser)``."""
    action = _find_action(parser, BACKEND_FLAG)
    if action.choices is not None and BACKEND_NAME not in action.choices:
        # A new list: SGLang's own choices list (from the field's Arg metadata) stays as it is.
        action.choices = list(action.choices) + [BACKEND_NAME]
        if action.help:
            action.help += (f" '{BACKEND_NAME}' runs SGLang's DeepEP path on uccl_ep_plugin.Buffer "
                            "(honours --deepep-mode and --deepep-config).")
    if not any(CONFIG_FLAG in a.option_strings for a in parser._actions):
        parser.add_argument(
            CONFIG_FLAG, dest=CONFIG_DEST, type=str, default=None, metavar="PLATFORM_OR_PATH",
            help="UCCL-EP platform config for --moe-a2a-backend uccl: a platform name "
                 "(default, efa, broadcom-thor2, amd-pollara, nvidia-connectx) or a YAML file. "
                 "Default: $UCCL_EP_CONFIG, else the platform detected from the NICs.")
    return None


def carry_config_flag(server_args, cls, args, *more, **kwargs):
    """AFTER hook of ``ServerArgs.from_cli_args(args)``."""
    chosen = getattr(args, CONFIG_DEST, None)
    if chosen:
        setattr(server_args, CONFIG_CHOICE_ATTR, chosen)
    return None


def select_deepep_path_for_uccl(server_args, *args, **kwargs):
    """BEFORE hook of ``ServerArgs.resolve_once(self)``."""
    if getattr(server_args, "moe_a2a_backend", None) != BACKEND_NAME:
        return None
    resolve_platform_config(getattr(server_args, CONFIG_CHOICE_ATTR, None))
    setattr(server_args, "moe_a2a_backend", DEEPEP_BACKEND_NAME)
    setattr(server_args, SELECTED_ATTR, True)
    logger().info("uccl: --moe-a2a-backend uccl selected: SGLang runs its DeepEP dispatcher "
                  "(--deepep-mode %s%s) with uccl_ep_plugin.Buffer/Config",
                  getattr(server_args, "deepep_mode", "?"),
                  ", --deepep-config given" if getattr(server_args, "deepep_config", None) else "")
    return None


def accept_uccl_in_enum(original_missing, cls, value, *args, **kwargs):
    """AROUND hook of the classmethod ``MoeA2ABackend._missing_(value)``."""
    if value == BACKEND_NAME:
        return cls.DEEPEP
    return original_missing(cls, value, *args, **kwargs)
