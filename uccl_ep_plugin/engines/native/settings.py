"""Settings of the native engine read from the environment when a Buffer is made."""

import os
from typing import Sequence


def mode_setting(env: str, modes: Sequence[str]) -> str:
    """The mode ``env`` names (case and surrounding spaces ignored), else ``modes[0]``; another value raises
    naming ``env`` and the modes it takes."""
    mode = os.environ.get(env, "").strip().lower() or modes[0]
    if mode not in modes:
        raise ValueError(f"{env}={mode!r}: expected one of {', '.join(modes)}")
    return mode
