"""Choosing the engine behind each Buffer operation (``UCCL_EP_ENGINE=native|reference|auto``)."""

import os
from dataclasses import dataclass, field
from typing import Dict

import torch

from . import native

OPERATIONS = ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine")
ENGINE_ENV = "UCCL_EP_ENGINE"
ENGINE_MODES = ("auto", "native", "reference")


@dataclass
class EngineChoice:
    mode: str
    by_operation: Dict[str, str] = field(default_factory=dict)      # operation -> "native" | "reference"
    reasons: Dict[str, str] = field(default_factory=dict)           # operation -> why native cannot serve it

    @property
    def summary(self) -> str:
        names = set(self.by_operation.values())
        return names.pop() if len(names) == 1 else "mixed"


def requested_mode() -> str:
    mode = os.environ.get(ENGINE_ENV, "auto").strip().lower() or "auto"
    if mode not in ENGINE_MODES:
        raise ValueError(f"{ENGINE_ENV}={mode!r} is not one of {', '.join(ENGINE_MODES)}")
    return mode


def choose(mode: str, device: torch.device) -> EngineChoice:
    """Per operation: native where it can run (auto/native), else reference.

    With ``native`` an operation the native engine cannot serve stays marked native, so calling it
    raises instead of falling back.
    """
    choice = EngineChoice(mode)
    if mode == "native" and device.type != "cuda":
        raise RuntimeError(f"{ENGINE_ENV}=native: {native.unsupported_reason('dispatch', device)}")
    unvalidated = native.unvalidated_reason() if mode == "auto" and device.type == "cuda" else None
    for operation in OPERATIONS:
        reason = None if mode == "reference" else native.unsupported_reason(operation, device) or unvalidated
        if mode == "reference":
            choice.by_operation[operation] = "reference"
        elif reason is None or mode == "native":
            choice.by_operation[operation] = "native"
        else:
            choice.by_operation[operation] = "reference"
        if reason is not None and mode != "reference":
            choice.reasons[operation] = reason
    return choice
