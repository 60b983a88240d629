"""The GPU->CPU command channel alone (``uccl-ep bench --mode channel``): FIFOs of 16-byte commands in
pinned mapped host memory between GPU threads and host threads, with no transport and no proxy work.

Two measurements on the current GPU (``torch.cuda.current_device()``):

* latency: one GPU thread pushes a command, a host thread takes it and stores an acknowledgement in
  mapped host memory, and the GPU thread times push -> acknowledgement seen with its globaltimer.
  Push-to-pop is part of that round trip, so the round trip bounds it from above; no one-way figure
  is derived from it.
* throughput: every SM pushes (one block of 128 threads per SM, split over 1, 2, 4 or 8 FIFOs), one
  checking host thread per FIFO; commands per second from the first push to the last pop. Every
  command must arrive once, untorn and in its producer's order, or the row is marked wrong.
"""

import datetime
import math
import sys
from typing import Dict, List, Optional, Sequence, TextIO

import torch

from ..build_info import build_info
from .report import table, write_json

LATENCY_ITERATIONS = 20000          # about 0.1 s of round trips of a few us
LATENCY_CAPACITY = 1024
THREADS_PER_BLOCK = 128
# (FIFOs, capacity): every SM into 1..8 rings of the usual size, then every SM through one small ring.
THROUGHPUT_CASES = ((1, 1024), (2, 1024), (4, 1024), (8, 1024), (1, 64))
TARGET_SECONDS = 0.075              # a timed throughput run: long enough to hide launch and thread start
PROBE_COMMANDS_PER_THREAD = 4       # the untimed run before each timed one: warms up and sizes it
MAX_COMMANDS_PER_THREAD = (1 << 24) - 1   # a producer's sequence number has 24 bits (stress.h)
TIMEOUT_S = 60.0
GOAL_MCMDS_PER_S = 10.0
GOAL_PUSH_TO_POP_US = 3.0

LATENCY_COLUMNS = (("iterations", "round trips", "{}"), ("capacity", "capacity", "{}"),
                   ("min_us", "min us", "{:.2f}"), ("p10_us", "p10 us", "{:.2f}"),
                   ("median_us", "median us", "{:.2f}"), ("p90_us", "p90 us", "{:.2f}"),
                   ("p99_us", "p99 us", "{:.2f}"), ("max_us", "max us", "{:.2f}"),
                   ("loop_mean_us", "loop mean us", "{:.2f}"), ("timer_step_ns_at_most", "timer step ns <=", "{}"),
                   ("correct", "correct", "{}"))
THROUGHPUT_COLUMNS = (("fifos", "FIFOs", "{}"), ("blocks_per_fifo", "blocks/FIFO", "{}"),
                      ("threads_per_block", "threads", "{}"), ("capacity", "capacity", "{}"),
                      ("commands", "commands", "{}"), ("ms", "ms", "{:.1f}"), ("mcmds_per_s", "M cmd/s", "{:.2f}"),
                      ("lost", "lost", "{}"), ("torn", "torn", "{}"), ("out_of_order", "out of order", "{}"),
                      ("correct", "correct", "{}"))


def unavailable_reason(device: str) -> Optional[str]:
    """Why the channel benchmark cannot run here (``device``: the bench's --device), or None."""
    if device == "cpu":
        return "it times GPU threads pushing to host threads, so it needs a CUDA GPU (--device cpu given)"
    if not torch.cuda.is_available():
        return "it times GPU threads pushing to host threads, and no CUDA GPU is visible"
    try:
        features = build_info()["features"]
    except ImportError as error:
        return str(error)
    if "gpu_channel" not in features:
        return "this build of uccl_ep_plugin._C has no GPU channel (it was built without CUDA)"
    return None


def percentile(ascending: Sequence[int], fraction: float) -> int:
    """Nearest rank: the smallest value with at least ``fraction`` of the values at or below it."""
    return ascending[max(1, math.ceil(fraction * len(ascending))) - 1]


def timer_step_ns_at_most(ascending: Sequence[int]) -> Optional[int]:
    """The smallest gap between distinct samples: the clock's step divides every gap, so it is at most this."""
    distinct = sorted(set(ascending))
    return min((b - a for a, b in zip(distinct, distinct[1:])), default=None)


def latency_stats(round_trip_ns: Sequence[int]) -> Dict[str, Optional[float]]:
    """Round-trip statistics in us (nearest-rank percentiles); None where no round trip completed."""
    ascending = sorted(round_trip_ns)
    if not ascending:
        return {key: None for key in ("min_us", "p10_us", "median_us", "p90_us", "p99_us", "max_us",
                                      "timer_step_ns_at_most")}
    return {"min_us": ascending[0] / 1e3, "p10_us": percentile(ascending, 0.10) / 1e3,
            "median_us": percentile(ascending, 0.50) / 1e3, "p90_us": percentile(ascending, 0.90) / 1e3,
            "p99_us": percentile(ascending, 0.99) / 1e3, "max_us": ascending[-1] / 1e3,
            "timer_step_ns_at_most": timer_step_ns_at_most(ascending)}


def _delivered_every_command(raw: Dict) -> bool:
    return raw["pushed"] == raw["expected"] and (raw["lost"], raw["torn"], raw["out_of_order"]) == (0, 0, 0)


def measure_latency(meta: Dict) -> Dict:
    """Round trips of one command at a time through one FIFO."""
    from .. import _C
    raw = _C.channel_latency_gpu(LATENCY_ITERATIONS, LATENCY_CAPACITY, TIMEOUT_S)
    completed = len(raw["round_trip_ns"])
    return {"mode": "channel", "op": "latency", "iterations": raw["iterations"], "warmup": raw["warmup"],
            "capacity": raw["capacity"], "completed": completed, **latency_stats(raw["round_trip_ns"]),
            # One clock span over all timed round trips: its mean hardly depends on the timer's step.
            "loop_mean_us": raw["loop_ns"] / completed / 1e3 if raw["loop_ns"] and completed else None,
            "lost": raw["lost"], "torn": raw["torn"], "out_of_order": raw["out_of_order"], "error": raw["error"],
            "correct": raw["error"] is None and completed == raw["iterations"] and _delivered_every_command(raw),
            **meta}


def blocks_per_fifo(num_sms: int, num_fifos: int) -> int:
    """Blocks feeding each FIFO so that all FIFOs together have about one block per SM."""
    return max(1, num_sms // num_fifos)


def commands_per_thread_for(commands_per_s: float, producers: int) -> int:
    """Commands each producer pushes so that a run at ``commands_per_s`` lasts about TARGET_SECONDS."""
    wanted = math.ceil(commands_per_s * TARGET_SECONDS / producers)
    return min(MAX_COMMANDS_PER_THREAD, max(PROBE_COMMANDS_PER_THREAD, wanted))


def measure_throughput(num_fifos: int, capacity: int, num_sms: int, meta: Dict) -> Dict:
    """Every SM pushing into ``num_fifos`` FIFOs; an untimed probe run sizes the timed one."""
    from .. import _C
    blocks = blocks_per_fifo(num_sms, num_fifos)
    producers = num_fifos * blocks * THREADS_PER_BLOCK

    def run(commands_per_thread: int) -> Dict:
        return _C.channel_stress_gpu(num_fifos, blocks, THREADS_PER_BLOCK, commands_per_thread, capacity, TIMEOUT_S)

    probe = run(PROBE_COMMANDS_PER_THREAD)
    raw = probe  # a probe that lost commands is the row: a longer run would not make it right
    if _delivered_every_command(probe):
        raw = run(commands_per_thread_for(probe["expected"] / max(probe["seconds"], 1e-9), producers))
    return {"mode": "channel", "op": "throughput", "fifos": num_fifos, "blocks_per_fifo": blocks,
            "threads_per_block": THREADS_PER_BLOCK, "producers": producers, "capacity": capacity,
            "commands": raw["expected"], "ms": raw["seconds"] * 1e3,
            "mcmds_per_s": raw["popped"] / raw["seconds"] / 1e6, "pushed": raw["pushed"], "popped": raw["popped"],
            "lost": raw["lost"], "torn": raw["torn"], "out_of_order": raw["out_of_order"],
            "correct": _delivered_every_command(raw), **meta}


def _status(result: Dict) -> str:
    return "ok" if result["correct"] else "WRONG"


def latency_progress_line(result: Dict) -> str:
    figures = (f"round trip median {result['median_us']:.2f} us, p99 {result['p99_us']:.2f} us"
               if result["median_us"] is not None else "no round trip timed")
    error = f": {result['error']}" if result["error"] else ""
    return (f"channel latency: {figures} over {result['completed']} of {result['iterations']} round trips, "
            f"{_status(result)}{error}")


def throughput_progress_line(result: Dict) -> str:
    return (f"channel throughput: {result['fifos']} FIFO(s) x {result['blocks_per_fifo']} blocks x "
            f"{result['threads_per_block']} threads, capacity {result['capacity']}: "
            f"{result['mcmds_per_s']:.2f} M commands/s, {_status(result)}")


def run_channel_benchmark(commit: str, progress: Optional[TextIO] = None) -> List[Dict]:
    """Latency, then the throughput sweep, on the current GPU; one JSON-able dict per row.

    Progress lines go to ``progress`` (default: sys.stderr at the time of the call)."""
    progress = progress or sys.stderr
    index = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    meta = {"device": properties.name, "gpu_index": index, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
    total = 1 + len(THROUGHPUT_CASES)
    print(f"uccl-ep bench --mode channel: {properties.name} (cuda:{index}, {properties.multi_processor_count} SMs), "
          f"{total} cases", file=progress, flush=True)
    results = [measure_latency(meta)]
    print(f"[1/{total}] {latency_progress_line(results[0])}", file=progress, flush=True)
    for num_fifos, capacity in THROUGHPUT_CASES:
        results.append(measure_throughput(num_fifos, capacity, properties.multi_processor_count, meta))
        print(f"[{len(results)}/{total}] {throughput_progress_line(results[-1])}", file=progress, flush=True)
    return results


def goal_lines(results: List[Dict]) -> List[str]:
    """Where the correct rows stand against the goals (>= 10 M commands/s, push-to-pop median < 3 us)."""
    lines = []
    rates = [r for r in results if r["op"] == "throughput" and r["correct"]]
    if rates:
        best = max(rates, key=lambda r: r["mcmds_per_s"])
        verdict = "met" if best["mcmds_per_s"] >= GOAL_MCMDS_PER_S else "NOT met"
        lines.append(f"throughput goal >= {GOAL_MCMDS_PER_S:g} M commands/s per GPU: best {best['mcmds_per_s']:.2f} "
                     f"({best['fifos']} FIFO(s), capacity {best['capacity']}): {verdict}")
    latency = [r for r in results if r["op"] == "latency" and r["correct"]]
    if latency:
        median = latency[0]["median_us"]
        verdict = ("met: push-to-pop is at most the round trip" if median < GOAL_PUSH_TO_POP_US else
                   "not shown: push-to-pop is only known to be at most the round trip")
        lines.append(f"latency goal push-to-pop median < {GOAL_PUSH_TO_POP_US:g} us: round trip (push -> host pop "
                     f"-> acknowledgement seen by the GPU) median {median:.2f} us; {verdict}")
    return lines


def print_channel_summary(results: List[Dict], stream: Optional[TextIO] = None) -> None:
    """Both tables, the goal verdicts and the overall verdict, to ``stream`` (default: sys.stdout)."""
    stream = stream or sys.stdout
    latency = [r for r in results if r["op"] == "latency"]
    throughput = [r for r in results if r["op"] == "throughput"]
    print("Round trips of one command (push -> host pop -> acknowledgement seen by the GPU; push-to-pop is at most "
          "this):", file=stream)
    print(table(latency, LATENCY_COLUMNS), file=stream)
    print("Round trips are timed with the GPU's globaltimer, whose step may be 32 ns to 1 us (upper bound in "
          "'timer step ns <='); 'loop mean us' is one clock span over all timed round trips divided by their "
          "count, so the step hardly matters there.", file=stream)
    print("\nEvery SM pushing, one checking host thread per FIFO:", file=stream)
    print(table(throughput, THROUGHPUT_COLUMNS), file=stream)
    print("", file=stream)
    for line in goal_lines(results):
        print(line, file=stream)
    wrong = [r for r in results if not r["correct"]]
    verdict = "all results correct" if not wrong else f"{len(wrong)} result(s) WRONG"
    print(f"{len(results)} cases, {verdict} (every command checked: delivered once, untorn, in order)", file=stream)


def run_from_cli(device: str, json_path: Optional[str], commit: str) -> int:
    """``uccl-ep bench --mode channel``: 0 if every row is correct, 1 if not, 2 if it cannot run here."""
    reason = unavailable_reason(device)
    if reason is not None:
        print(f"uccl-ep bench --mode channel: cannot run: {reason}", file=sys.stderr)
        return 2
    results = run_channel_benchmark(commit)
    print_channel_summary(results)
    if json_path:
        write_json(results, json_path)
        print(f"wrote {json_path}")
    return 0 if all(r["correct"] for r in results) else 1
