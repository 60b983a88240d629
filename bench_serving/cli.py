"""Serving throughput and latency of an engine (vLLM or SGLang) across expert-parallel all-to-all backends.

``python -m bench_serving`` / ``uccl-ep bench-serving``: the arguments, checked before anything starts, and the
loop over the backends."""

import argparse
import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .backends import BASELINE, DEFAULT_BACKENDS, ENGINES, SERVER_MODULES, backends
from .client import ClientError, Requests, client_command, read_metrics, run_client
from .report import Run, plot, table, write_json
from .server import OFFLINE_ENV, ServerError, ServerProcess


class UsageError(ValueError):
    """A bad argument: one line naming it and the rule."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="vllm", help="the serving engine (default vllm)")
    parser.add_argument("--model", required=True, help="the model (path or hub name) every server loads")
    parser.add_argument("--served-model-name", default=None, help="its name in requests (default: the model's "
                        "last path component)")
    parser.add_argument("--tokenizer", default=None, help="the client's tokenizer (default: the model)")
    parser.add_argument("--backends", default=None,
                        help=f"comma-separated all-to-all backends as the engine names them, and '{BASELINE}' for "
                             f"the baseline without expert parallelism (default: vllm "
                             f"{','.join(DEFAULT_BACKENDS['vllm'])}; sglang {','.join(DEFAULT_BACKENDS['sglang'])})")
    parser.add_argument("--parallel", type=int, default=2, help="expert-parallel ranks (vLLM: data-parallel size "
                        "with expert parallelism; SGLang: tp and ep size; default 2)")
    parser.add_argument("--baseline-tp", type=int, default=1, help=f"tensor-parallel size of '{BASELINE}' (default 1)")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests per backend (default 200)")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request set (default 0)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="one more server argument for every backend (repeat; write --server-arg=--flag)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for every server (repeat)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter of the engine's environment (default: this one)")
    parser.add_argument("--out", default="bench_serving_results", help="folder for the JSONs, table, plot and logs")
    parser.add_argument("--health-timeout", type=float, default=900.0,
                        help="seconds a server may take to become healthy (default 900)")
    parser.add_argument("--client-timeout", type=float, default=3600.0,
                        help="seconds the benchmark client may take per backend (default 3600)")
    parser.add_argument("--offline", action="store_true", help="no hub look-ups (a local model)")


def _check(args: argparse.Namespace) -> None:
    for name in ("parallel", "baseline_tp", "num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if not args.request_rate > 0:
        raise UsageError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    for name in ("health_timeout", "client_timeout"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0 seconds (got {getattr(args, name)})")
    for item in args.env:
        if "=" not in item or not item.split("=", 1)[0]:
            raise UsageError(f"--env {item!r}: expected KEY=VALUE")
    names = [name.strip() for name in (args.backends or "").split(",") if name.strip()]
    if args.backends is not None and not names:
        raise UsageError("--backends names no backend")
    if len(set(names)) != len(names):
        raise UsageError(f"--backends names a backend twice: {args.backends}")
    if not os.path.exists(args.python):
        raise UsageError(f"--python {args.python}: no such interpreter")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("the plot needs matplotlib: pip install 'uccl-ep-plugin[bench]' (or matplotlib)")


def _engine_version(python: str, engine: str) -> str:
    """The engine's version in its environment; UsageError if it cannot be imported there."""
    module = "vllm" if engine == "vllm" else "sglang"
    done = subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise UsageError(f"--python {python} cannot import {module}: "
                         f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return done.stdout.strip().splitlines()[-1]


def run(args: argparse.Namespace) -> int:
    _check(args)
    names = [n.strip() for n in args.backends.split(",")] if args.backends else list(DEFAULT_BACKENDS[args.engine])
    version = _engine_version(args.python, args.engine)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    served_name = args.served_model_name or Path(args.model.rstrip("/")).name
    requests = Requests(args.num_prompts, args.input_len, args.output_len, args.request_rate, args.seed)
    env: Dict[str, str] = dict(item.split("=", 1) for item in args.env)
    if args.offline:
        env.update(OFFLINE_ENV)
    model_flag = "--model" if args.engine == "vllm" else "--model-path"
    runs: List[Run] = []
    print(f"bench_serving: {args.engine} {version}, model {args.model}, {len(names)} backend(s), "
          f"{requests.num_prompts} requests of {requests.input_len} -> {requests.output_len} tokens; results in {out}",
          flush=True)
    for index, spec in enumerate(backends(args.engine, names, args.parallel, args.baseline_tp)):
        server_args = [model_flag, args.model, "--served-model-name", served_name, *spec.args, *args.server_arg]
        settings = {"server_args": server_args, "env": env, "parallel": args.parallel,
                    "requests": dict(vars(requests), request_rate=str(requests.request_rate))}
        current = Run(spec.name, args.engine, version, settings,
                      logs={"server": str(out / "logs" / f"{spec.name}-server.log"),
                            "client": str(out / "logs" / f"{spec.name}-client.log")})
        started = time.monotonic()
        print(f"[{index + 1}/{len(names)}] {spec.name}: starting the server", flush=True)
        server = ServerProcess(args.python, SERVER_MODULES[args.engine], server_args, Path(current.logs["server"]),
                               env=env, name=spec.name)
        try:
            server.start()
            seconds = server.wait_healthy(args.health_timeout)
            print(f"[{index + 1}/{len(names)}] {spec.name}: healthy after {seconds:.0f} s; "
                  f"sending {requests.num_prompts} requests", flush=True)
            result = out / f"{index:02d}-{spec.name}-client.json"
            run_client(client_command(args.engine, args.python, server.url(), served_name, args.tokenizer or args.model,
                                      requests, result), Path(current.logs["client"]), args.client_timeout)
            current.metrics = read_metrics(args.engine, result, requests)
        except (ServerError, ClientError) as error:
            current.error = str(error)
        finally:
            server.stop()
        runs.append(current)
        write_json(current, out, index)
        what = (f"{current.metrics.output_throughput:.1f} output tokens/s, {current.metrics.failed} failed"
                if current.served else "not served: " + current.error.splitlines()[0])
        print(f"[{index + 1}/{len(names)}] {spec.name}: {what} ({time.monotonic() - started:.0f} s)", flush=True)
    text = table(runs)
    (out / "table.txt").write_text(text + "\n")
    print("\n" + text)
    figure = plot(runs, out / "serving.png", f"{args.engine} {version}, {served_name}, "
                                             f"{requests.num_prompts} requests {requests.input_len}->{requests.output_len}")
    print(f"\nplot: {figure}")
    return 0 if any(r.served for r in runs) else 1


def main(argv: Optional[List[str]] = None, prog: str = "python -m bench_serving") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
