"""Entry point of the ``uccl-ep`` console script.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds
its parser and sets ``handler`` (a callable taking the parsed namespace and returning
an exit code).
"""

import argparse
import sys
from typing import List, Optional

from . import bench, bench_serving_cmd, config_cmd, doctor

SUBCOMMANDS = (bench, bench_serving_cmd, doctor, config_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uccl-ep",
        description="uccl-ep-plugin: portable expert-parallel dispatch/combine for MoE.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
