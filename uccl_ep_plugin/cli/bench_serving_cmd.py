"""``uccl-ep bench-serving``: the serving benchmark (bench_serving/, installed as uccl_ep_plugin.bench_serving)."""

import argparse
import sys


def register(subparsers) -> None:
    from uccl_ep_plugin.bench_serving import cli
    parser = subparsers.add_parser("bench-serving", help="serving throughput of vLLM or SGLang per all-to-all backend",
                                   description=cli.__doc__.splitlines()[0])
    cli.add_arguments(parser)
    parser.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from uccl_ep_plugin.bench_serving import cli
    try:
        return cli.run(args)
    except cli.UsageError as error:
        print(f"uccl-ep bench-serving: error: {error}", file=sys.stderr)
        return 2
