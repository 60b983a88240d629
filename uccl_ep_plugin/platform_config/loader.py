"""Finding, reading and layering the platform config files.

Precedence, highest first:

1. ``overrides`` passed by the caller ("argument"),
2. an environment variable of the same name as the key ("environment"),
3. the chosen file: ``config_file`` and/or ``platform`` (each either a platform name
   or a path to a YAML file); when both are ``None`` the ``UCCL_EP_CONFIG``
   environment variable supplies one,
4. the file of the platform auto-detected from ``<root>/sys/class/infiniband``,
5. ``default.yaml``.

``UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC`` left null by all of these is resolved from the
GPU vendor: 1 on ROCm builds of torch, 0 otherwise.
"""

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import yaml

from .detect import detect_platform, detect_rdma_devices, detected_platforms
from .schema import SCHEMA, STR, ConfigError, check_document, check_value, format_value, parse_string

CONFIG_ENV_VAR = "UCCL_EP_CONFIG"
DEFAULT_FILE = "default.yaml"
AUTO_ATOMIC_KEY = "UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC"
AUTO_ATOMIC_SOURCE = "auto (GPU vendor)"

__all__ = [
    "ConfigError", "ResolvedConfig", "available_platforms", "config_dir",
    "detect_platform", "detect_rdma_devices", "detected_platforms", "load_file",
    "resolve_config",
]


def config_dir():
    """The folder holding the shipped YAML files.

    Installed packages carry them as ``uccl_ep_plugin.configs`` (setup.py maps that
    package to the top-level ``configs/`` folder), found with importlib.resources;
    a source checkout falls back to ``configs/`` at the repository root. Returns an
    ``importlib.resources`` Traversable or a ``pathlib.Path`` (same interface).
    """
    try:
        from importlib.resources import files
        candidate = files("uccl_ep_plugin.configs")
        if candidate.joinpath(DEFAULT_FILE).is_file():
            return candidate
    except (ImportError, TypeError, ValueError, OSError):
        pass
    from pathlib import Path
    return Path(__file__).resolve().parent.parent.parent / "configs"


def available_platforms() -> List[str]:
    """Names of the shipped platform files (without ``.yaml``), sorted; excludes defaults."""
    names = []
    for entry in config_dir().iterdir():
        name = entry.name
        if name.endswith(".yaml") and name != DEFAULT_FILE:
            names.append(name[: -len(".yaml")])
    return sorted(names)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping."""


def _mapping_without_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # unhashable key; construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, "key %s is given twice" % (key,), key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _parse_yaml(text: str, origin: str) -> Tuple[Optional[str], Dict[str, Any]]:
    try:
        document = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError("%s: malformed YAML: %s" % (origin, detail)) from None
    return check_document(document, origin)


def load_file(name_or_path: str,
              origin: str = "platform") -> Tuple[str, Optional[str], Dict[str, Any]]:
    """Read and validate one config file given by platform name or path.

    ``origin`` says, in the error for an unknown platform name, where the name came
    from (such as "platform" or "UCCL_EP_CONFIG").

    Returns ``(label, platform, settings)``: ``label`` names the file in sources and
    messages ("efa.yaml" for a shipped file, the path otherwise), ``platform`` is the
    file's ``platform:`` entry (the name itself for a shipped platform file).
    """
    if _looks_like_path(name_or_path):
        path = os.path.expanduser(name_or_path)
        try:
            with open(path, "r", encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise ConfigError("%s: cannot read config file: %s"
                              % (name_or_path, exc.strerror or exc)) from None
        label = name_or_path
        platform, settings = _parse_yaml(text, label)
        return label, platform, settings
    name = name_or_path
    if name == "default":
        label = DEFAULT_FILE
    else:
        known = available_platforms()
        if name not in known:
            raise ConfigError("%s: unknown platform %r (available: %s; or give a path to "
                              "a YAML file)" % (origin, name, ", ".join(known)))
        label = name + ".yaml"
    text = config_dir().joinpath(label).read_text(encoding="utf-8")
    platform, settings = _parse_yaml(text, label)
    if name != "default":
        platform = platform or name
    return label, platform, settings


def _looks_like_path(value: str) -> bool:
    return (os.sep in value or "/" in value or value.endswith((".yaml", ".yml"))
            or value.startswith("~") or os.path.isfile(value))


@dataclass
class ResolvedConfig:
    """The outcome of :func:`resolve_config`."""

    #: Key -> resolved value (None where a nullable key stays unset).
    values: Dict[str, Any]
    #: Key -> where the value came from, for people to read.
    sources: Dict[str, str]
    #: Platform name of the chosen file, else the detected one, else None.
    platform: Optional[str]
    #: Platform auto-detected from sysfs (None when no known NIC).
    detected_platform: Optional[str] = None
    #: RDMA devices seen: (name, platform or None).
    rdma_devices: List[Tuple[str, Optional[str]]] = field(default_factory=list)
    #: Labels of the files applied, lowest precedence first.
    files: List[str] = field(default_factory=list)

    def as_environ(self) -> Dict[str, str]:
        """Environment variables a proxy/transport would read: non-null keys as strings."""
        return {key: format_value(value) for key, value in self.values.items()
                if value is not None}

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data form, for JSON output."""
        return {
            "platform": self.platform,
            "detected_platform": self.detected_platform,
            "rdma_devices": [{"name": name, "platform": platform}
                             for name, platform in self.rdma_devices],
            "files": list(self.files),
            "values": dict(self.values),
            "sources": dict(self.sources),
            "environ": self.as_environ(),
        }


def _gpu_is_amd() -> bool:
    """True when the installed torch targets ROCm/HIP (AMD GPUs)."""
    try:
        import torch
    except Exception:
        return False
    return bool(getattr(getattr(torch, "version", None), "hip", None))


def resolve_config(platform: Optional[str] = None,
                   config_file: Optional[str] = None,
                   overrides: Optional[Mapping[str, Any]] = None,
                   environ: Optional[Mapping[str, str]] = None,
                   root: str = "/") -> ResolvedConfig:
    """Layer defaults, detected platform, chosen file(s), environment and overrides.

    ``platform`` and ``config_file`` each accept a platform name or a path; when both
    are given, ``config_file`` is applied on top of ``platform``. When both are None,
    ``UCCL_EP_CONFIG`` from ``environ`` (default ``os.environ``) is used if set.
    ``overrides`` values may be native or strings (parsed like environment values).
    Raises :class:`ConfigError` on any invalid input.
    """
    env = os.environ if environ is None else environ

    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    files: List[str] = []

    def apply(settings: Dict[str, Any], source: str) -> None:
        for key, value in settings.items():
            values[key] = value
            sources[key] = source

    label, _, settings = load_file("default")
    missing = [key for key in SCHEMA if key not in settings]
    if missing:
        raise ConfigError("%s: %s: missing from the defaults file" % (label, missing[0]))
    apply(settings, label)
    files.append(label)

    devices = detect_rdma_devices(root)
    detected = detect_platform(root)
    chosen_platform: Optional[str] = None
    if detected is not None:
        label, _, settings = load_file(detected)
        apply(settings, "%s (auto-detected)" % label)
        files.append(label)

    # (name or path, where it came from, suffix for the source)
    chosen: List[Tuple[str, str, str]] = []
    if platform is None and config_file is None:
        from_env = env.get(CONFIG_ENV_VAR, "")
        if from_env.strip():
            chosen.append((from_env.strip(), CONFIG_ENV_VAR, " (%s)" % CONFIG_ENV_VAR))
    else:
        if platform is not None:
            chosen.append((platform, "platform", ""))
        if config_file is not None:
            chosen.append((config_file, "config_file", ""))
    for name_or_path, origin, suffix in chosen:
        label, file_platform, settings = load_file(name_or_path, origin)
        apply(settings, label + suffix)
        files.append(label)
        if file_platform is not None:
            chosen_platform = file_platform

    for key in SCHEMA:
        raw = env.get(key)
        if raw is None or raw.strip() == "":
            continue
        values[key] = parse_string(key, raw, "environment")
        sources[key] = "environment"

    for key, value in (overrides or {}).items():
        if key not in SCHEMA:
            check_value(str(key), value, "argument")  # raises: unknown key
        if isinstance(value, str) and SCHEMA[key].kind != STR:
            values[key] = parse_string(key, value, "argument")
        else:
            values[key] = check_value(key, value, "argument")
        sources[key] = "argument"

    if values.get(AUTO_ATOMIC_KEY) is None:
        values[AUTO_ATOMIC_KEY] = 1 if _gpu_is_amd() else 0
        sources[AUTO_ATOMIC_KEY] = AUTO_ATOMIC_SOURCE

    ordered_values = {key: values[key] for key in SCHEMA}
    ordered_sources = {key: sources[key] for key in SCHEMA}
    return ResolvedConfig(
        values=ordered_values,
        sources=ordered_sources,
        platform=chosen_platform if chosen_platform is not None else detected,
        detected_platform=detected,
        rdma_devices=devices,
        files=files,
    )

