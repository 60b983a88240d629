"""The keys a platform config may set, their types and ranges, and their validation.

Every key mirrors an environment variable that UCCL-EP's proxies and transport read.
Values come from three kinds of places, each checked here:

* YAML files (native YAML types: ints, strings, null),
* the process environment (always strings, parsed according to the key's type),
* an explicit overrides dict passed by the caller (native values, or strings that are
  parsed like environment values).
"""

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple


class ConfigError(ValueError):
    """A platform config, environment variable or override is invalid.

    The message names where the value came from (a file, "environment" or
    "argument") and the offending key.
    """


# Value kinds.
INT = "int"
STR = "str"
FLAG = "flag"  # 0 or 1

# Strings accepted in the environment for a key that allows null.
_NULL_WORDS = ("null", "none", "auto", "unset", "unlimited")
_FLAG_WORDS = {
    "0": 0, "false": 0, "no": 0, "off": 0,
    "1": 1, "true": 1, "yes": 1, "on": 1,
}


@dataclass(frozen=True)
class KeySpec:
    name: str
    kind: str
    nullable: bool = False
    minimum: Optional[int] = None
    maximum: Optional[int] = None
    doc: str = ""

    def describe(self) -> str:
        """Human-readable description of the accepted values."""
        if self.kind == FLAG:
            text = "0 or 1"
        elif self.kind == STR:
            text = "a non-empty string"
        else:
            if self.minimum is not None and self.maximum is not None:
                text = "an integer in %d..%d" % (self.minimum, self.maximum)
            elif self.minimum is not None:
                text = "an integer >= %d" % self.minimum
            elif self.maximum is not None:
                text = "an integer <= %d" % self.maximum
            else:
                text = "an integer"
        if self.nullable:
            text += " or null"
        return text


_SPECS = (
    KeySpec("UCCL_SOCKET_IFNAME", STR, nullable=True,
            doc="network interface for the TCP bootstrap (null: automatic)"),
    KeySpec("UCCL_IB_GID_INDEX", INT, minimum=-1,
            doc="RoCE GID index (-1: automatic)"),
    KeySpec("UCCL_IB_MAX_INFLIGHT_BYTES", INT, nullable=True, minimum=1,
            doc="bytes in flight per GPU/NIC (null: unlimited)"),
    KeySpec("UCCL_IB_MAX_INFLIGHT_NORMAL", INT, minimum=1,
            doc="RDMA writes in flight per GPU/NIC, normal mode"),
    KeySpec("UCCL_IB_MAX_INFLIGHT_LOW_LATENCY", INT, minimum=1,
            doc="RDMA writes in flight per GPU/NIC, low-latency mode"),
    KeySpec("UCCL_IB_SL", INT, minimum=0, maximum=15,
            doc="InfiniBand service level"),
    KeySpec("UCCL_IB_TC", INT, minimum=0, maximum=255,
            doc="traffic class"),
    KeySpec("UCCL_IB_QPS_PER_PEER", INT, minimum=1, maximum=64,
            doc="RDMA queue pairs to each peer (requests take them in turn)"),
    KeySpec("UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC", FLAG, nullable=True,
            doc="aggressive atomics (null: 1 on AMD GPUs, 0 on CUDA)"),
    KeySpec("UCCL_RDMA_ADAPTIVE_SLEEP", FLAG,
            doc="idle proxy threads sleep instead of spinning"),
    KeySpec("UCCL_IB_NATIVE_ATOMICS", FLAG,
            doc="counter adds as the NIC's own atomics where it has them in order (0: always as immediates; "
                "every rank the same)"),
)

#: Key name -> spec, in a fixed display order.
SCHEMA: Dict[str, KeySpec] = {spec.name: spec for spec in _SPECS}

#: Top-level keys that are metadata rather than settings.
META_KEYS = ("platform",)


def _fail(origin: str, key: str, message: str) -> ConfigError:
    return ConfigError("%s: %s: %s" % (origin, key, message))


def check_value(key: str, value: Any, origin: str) -> Any:
    """Validate a native value (from YAML or an overrides dict) for ``key``.

    Returns the normalised value (flags given as booleans become 0/1).
    ``origin`` names the place the value came from, for error messages.
    """
    spec = SCHEMA.get(key)
    if spec is None:
        raise _fail(origin, str(key), "unknown key (known keys: %s)" % ", ".join(SCHEMA))
    if value is None:
        if spec.nullable:
            return None
        raise _fail(origin, key, "must not be null; expected %s" % spec.describe())
    if spec.kind == STR:
        if not isinstance(value, str):
            raise _fail(origin, key, "expected %s, got %s %r"
                        % (spec.describe(), type(value).__name__, value))
        if not value.strip():
            raise _fail(origin, key, "expected %s, got an empty string" % spec.describe())
        return value
    if spec.kind == FLAG:
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int) and value in (0, 1):
            return int(value)
        raise _fail(origin, key, "expected %s, got %s %r"
                    % (spec.describe(), type(value).__name__, value))
    # INT: bool is a subclass of int but is never a sensible count or index.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(origin, key, "expected %s, got %s %r"
                    % (spec.describe(), type(value).__name__, value))
    if spec.minimum is not None and value < spec.minimum:
        raise _fail(origin, key, "%d is out of range; expected %s" % (value, spec.describe()))
    if spec.maximum is not None and value > spec.maximum:
        raise _fail(origin, key, "%d is out of range; expected %s" % (value, spec.describe()))
    return value


def parse_string(key: str, text: str, origin: str) -> Any:
    """Parse a string value (an environment variable) for ``key`` and validate it."""
    spec = SCHEMA.get(key)
    if spec is None:
        raise _fail(origin, key, "unknown key")
    stripped = text.strip()
    if spec.nullable and stripped.lower() in _NULL_WORDS:
        return None
    if spec.kind == STR:
        return check_value(key, stripped, origin)
    if spec.kind == FLAG:
        if stripped.lower() not in _FLAG_WORDS:
            raise _fail(origin, key, "cannot parse %r; expected %s" % (text, spec.describe()))
        return _FLAG_WORDS[stripped.lower()]
    try:
        number = int(stripped, 10)
    except ValueError:
        number = None
    if number is None:
        try:  # also accept 0x.. / 0o.. / 0b.. spellings
            number = int(stripped, 0)
        except ValueError:
            raise _fail(origin, key, "cannot parse %r as an integer; expected %s"
                    % (text, spec.describe())) from None
    return check_value(key, number, origin)


def check_document(document: Any, origin: str) -> Tuple[Optional[str], Dict[str, Any]]:
    """Validate a parsed YAML document; return ``(platform_label, settings)``.

    An empty document is an empty mapping. Anything else that is not a mapping,
    unknown keys, wrong types and out-of-range values raise :class:`ConfigError`.
    """
    if document is None:
        return None, {}
    if not isinstance(document, dict):
        raise ConfigError("%s: expected a mapping of settings at the top level, got %s"
                          % (origin, type(document).__name__))
    label = document.get("platform")
    if label is not None and (not isinstance(label, str) or not label.strip()):
        raise _fail(origin, "platform", "expected a non-empty string, got %r" % (label,))
    settings: Dict[str, Any] = {}
    for key, value in document.items():
        if key in META_KEYS:
            continue
        if not isinstance(key, str):
            raise _fail(origin, repr(key), "unknown key (keys must be strings)")
        settings[key] = check_value(key, value, origin)
    return label, settings


def format_value(value: Any) -> str:
    """The string an environment variable would carry for ``value``."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
