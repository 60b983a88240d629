"""``uccl-ep config show``: the effective platform settings and where each came from."""

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Tuple

from uccl_ep_plugin.platform_config import ConfigError, ResolvedConfig, resolve_config


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config", help="show the resolved platform configuration",
        description="Inspect the UCCL-EP platform configuration.")
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION")
    actions.required = True
    show = actions.add_parser(
        "show", help="print every setting, its value and its source",
        description="Print every setting with its resolved value and where it came from "
                    "(argument > environment > chosen file > auto-detected platform > "
                    "default.yaml), and the RDMA devices detected.")
    show.add_argument("--platform", metavar="NAME", default=None,
                      help="platform name (or path to a YAML file) to apply over the defaults")
    show.add_argument("--config", metavar="FILE", default=None,
                      help="YAML file (or platform name) to apply; over --platform if both")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    # Filesystem root for sysfs detection; for tests and offline inspection.
    show.add_argument("--root", default="/", help=argparse.SUPPRESS)
    show.set_defaults(handler=run_show)


def format_value(value: Any) -> str:
    return "null" if value is None else str(value)


def config_rows(cfg: ResolvedConfig) -> List[Tuple[str, str, str]]:
    """(key, value, source) for every key, in schema order."""
    return [(key, format_value(value), cfg.sources[key]) for key, value in cfg.values.items()]


def render_table(rows: List[Tuple[str, str, str]],
                 headers: Tuple[str, str, str] = ("KEY", "VALUE", "SOURCE")) -> str:
    widths = [max(len(str(row[i])) for row in [headers] + rows) for i in range(len(headers))]
    lines = []
    for row in [headers] + rows:
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def render_devices(devices) -> str:
    if not devices:
        return "RDMA devices: none found"
    parts = ["%s (%s)" % (name, platform or "unknown") for name, platform in devices]
    return "RDMA devices: " + ", ".join(parts)


def render_config(cfg: ResolvedConfig) -> str:
    """The human-readable block shared by ``config show`` and ``doctor``."""
    lines = [
        "Platform: %s" % (cfg.platform or "none (defaults only)"),
        "Detected platform: %s" % (cfg.detected_platform or "none"),
        render_devices(cfg.rdma_devices),
        "Files applied: %s" % ", ".join(cfg.files),
        "",
        render_table(config_rows(cfg)),
    ]
    return "\n".join(lines)


def config_summary(cfg: ResolvedConfig) -> Dict[str, Any]:
    """The JSON form shared by ``config show --json`` and ``doctor --json``."""
    return cfg.to_dict()


def run_show(args) -> int:
    try:
        cfg = resolve_config(platform=args.platform, config_file=args.config,
                             root=getattr(args, "root", "/"))
    except ConfigError as exc:
        sys.stderr.write("uccl-ep config: error: %s\n" % " ".join(str(exc).split()))
        return 2
    if args.json:
        print(json.dumps(config_summary(cfg), indent=2, sort_keys=False))
    else:
        print(render_config(cfg))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run this subcommand alone (``python -m uccl_ep_plugin.cli.config_cmd show``)."""
    parser = argparse.ArgumentParser(prog="uccl-ep")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["config"] + list(sys.argv[1:] if argv is None else argv))
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
