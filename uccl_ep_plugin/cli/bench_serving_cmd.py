"""``uccl-ep bench-serving``: the serving benchmark (bench_serving/, installed as uccl_ep_plugin.bench_serving)."""

import argparse
import importlib
import sys


def _serving_cli():
    """The benchmark's CLI module: the installed subpackage, or ``bench_serving`` of a checkout run in place
    (``python -m uccl_ep_plugin.cli.main`` from the repository root, where nothing was installed)."""
    try:
        return importlib.import_module("uccl_ep_plugin.bench_serving.cli")
    except ModuleNotFoundError as error:
        if error.name not in ("uccl_ep_plugin.bench_serving", "uccl_ep_plugin.bench_serving.cli"):
            raise
        return importlib.import_module("bench_serving.cli")


def register(subparsers) -> None:
    cli = _serving_cli()
    parser = subparsers.add_parser("bench-serving", help="serving throughput of vLLM or SGLang per all-to-all backend",
                                   description=cli.__doc__.splitlines()[0])
    cli.add_arguments(parser)
    parser.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    cli = _serving_cli()
    try:
        return cli.run(args)
    except cli.UsageError as error:
        print(f"uccl-ep bench-serving: error: {error}", file=sys.stderr)
        return 2
