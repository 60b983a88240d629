"""Warnings the library gives its user: each once per process, without the line of our source that Python would
quote under it (it says nothing a user can act on). They stay RuntimeWarnings, so warnings filters apply."""

import warnings

_given = set()


def warn_once(message: str) -> None:
    """Warn ``message`` (printed as ``uccl_ep_plugin:0: RuntimeWarning: <message>``) unless this process already
    did."""
    if message in _given:
        return
    _given.add(message)
    warnings.warn_explicit(message, RuntimeWarning, filename="uccl_ep_plugin", lineno=0, module="uccl_ep_plugin")
