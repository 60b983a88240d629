"""Where the choice ``--moe-a2a-backend uccl`` is remembered once SGLang sees ``deepep``.

The plugin rewrites the record's ``moe_a2a_backend`` from ``uccl`` to ``deepep`` before
SGLang resolves its arguments (see ``backend_option``), so every place in SGLang that
branches on the backend takes the DeepEP branch. The original choice travels on the same
``ServerArgs`` record as a bookkeeping attribute: SGLang pickles a record's ``__dict__``
together with its fields (``ServerArgs.__reduce__``), so scheduler processes spawned from
the launcher receive it too.
"""

import logging

BACKEND_NAME = "uccl"
DEEPEP_BACKEND_NAME = "deepep"

# Bookkeeping attributes on sglang.srt.server_args.ServerArgs (leading underscore: SGLang
# lets such attributes be set at any time and pickles them with the record).
SELECTED_ATTR = "_uccl_ep_selected"
CONFIG_CHOICE_ATTR = "_uccl_ep_config"

LOGGER_NAME = "uccl_ep_plugin.integrations.sglang"


def logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def record_selects_uccl(server_args) -> bool:
    """True when this ServerArgs record asked for ``--moe-a2a-backend uccl``."""
    if server_args is None:
        return False
    if getattr(server_args, SELECTED_ATTR, False):
        return True
    return getattr(server_args, "moe_a2a_backend", None) == BACKEND_NAME


def published_record_selects_uccl() -> bool:
    """Whether the ServerArgs published in this process (SGLang's runtime context) chose uccl."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # nothing published in this process yet
        return False
    return record_selects_uccl(server_args)
