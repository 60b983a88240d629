"""Helpers shared by the multi-rank Buffer tests.

Spawning a process group costs seconds, so each test module runs one group per rank count
and performs all of its checks inside it. The checks are *soft*: a failed comparison is
recorded under the current section and the body carries on, so every rank keeps issuing
the same collectives in the same order (a rank that stopped early would leave its peers
waiting). Each rank writes its record to a file, again at every section's start and end and at
every failure, so a rank killed mid-body (a C++ thread's abort) still leaves what it saw and the
section it died in; the parent merges the records and every section becomes its own pytest item
through :func:`assert_section`.

Inputs are generated from ``(seed, rank)``, so any rank can regenerate any other rank's
tokens and compute the expected result of a collective on its own.
"""

import json
import logging
import os
import tempfile
import threading
import traceback
import warnings
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tests.multiprocess import run_ranks

MAX_MESSAGES_PER_SECTION = 12
# What a rank's record says of the section it was in when the record was last written; replaced when the section ends.
ENDED_INSIDE = "the rank ended inside this section (killed, or exited before the section finished)"
# A legitimate collective takes well under a second here; a desynchronised one fails fast instead of hanging.
TEST_TIMEOUT_SECONDS = "30"
# A whole body takes well under a minute; past this a rank gives up instead of waiting for run_ranks' 10 minutes.
BODY_DEADLINE_SECONDS = 240.0
SHUTDOWN_SECONDS = 20.0


def quiet_rank(timeout_seconds: str = TEST_TIMEOUT_SECONDS) -> None:
    """Per-process setup: no reference-engine banner, and a short communication timeout."""
    os.environ["UCCL_EP_TIMEOUT_SECONDS"] = timeout_seconds
    warnings.simplefilter("ignore", RuntimeWarning)
    logging.getLogger("uccl_ep_plugin").setLevel(logging.ERROR)


# ---------------------------------------------------------------------------------------- soft checks
class Recorder:
    """Collects failures per section without stopping the body; ``write``, if given, is handed a snapshot of the
    record (section -> messages, the current section marked :data:`ENDED_INSIDE`) whenever it changes."""

    def __init__(self, rank: int, write: Optional[Callable[[Dict[str, List[str]]], None]] = None) -> None:
        self.rank = rank
        self.sections: Dict[str, List[str]] = {}
        self._current: Optional[str] = None
        self._write = write

    @contextmanager
    def section(self, name: str):
        """Checks inside belong to ``name``; an unexpected exception is recorded, not raised."""
        self.sections.setdefault(name, [])
        previous, self._current = self._current, name
        self._persist()
        try:
            yield
        except Exception:  # noqa: BLE001 - recorded and reported by the section's pytest item
            self.fail("unexpected exception:\n" + traceback.format_exc())
        finally:
            self._current = previous
            self._persist()

    def _persist(self) -> None:
        if self._write is None:
            return
        snapshot = {name: list(messages) for name, messages in self.sections.items()}
        if self._current is not None:
            snapshot[self._current].append(ENDED_INSIDE)
        self._write(snapshot)

    def fail(self, message: str) -> None:
        if self._current is None:
            raise AssertionError(message)
        messages = self.sections[self._current]
        if len(messages) < MAX_MESSAGES_PER_SECTION:
            messages.append(message)
        elif len(messages) == MAX_MESSAGES_PER_SECTION:
            messages.append("... more failures in this section omitted")
        self._persist()

    def expect(self, condition: bool, message: str) -> bool:
        if not condition:
            self.fail(message)
        return bool(condition)

    def equal(self, got, expected, what: str) -> bool:
        """Exact equality of tensors (shape, dtype and bits) or of plain Python values."""
        if isinstance(expected, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                return self.expect(False, f"{what}: expected a tensor, got {type(got).__name__}")
            if got.dtype != expected.dtype:
                return self.expect(False, f"{what}: dtype {got.dtype}, expected {expected.dtype}")
            if got.shape != expected.shape:
                return self.expect(False, f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
            if got.dtype.is_floating_point:
                same = got.contiguous().view(_int_of(got.dtype)) == expected.contiguous().view(_int_of(got.dtype))
            else:
                same = got == expected
            if bool(same.all()):
                return True
            bad = (~same).nonzero()
            first = tuple(bad[0].tolist())
            return self.expect(False, f"{what}: {bad.size(0)} of {same.numel()} elements differ; first at {first}: "
                                      f"got {got[first].item()!r}, expected {expected[first].item()!r}")
        return self.expect(got == expected, f"{what}: got {got!r}, expected {expected!r}")

    def close(self, got: torch.Tensor, expected: torch.Tensor, what: str, rtol: float, atol) -> bool:
        """``|got - expected| <= atol + rtol * |expected|`` elementwise; ``atol`` may be a tensor."""
        if not isinstance(got, torch.Tensor):
            return self.expect(False, f"{what}: expected a tensor, got {type(got).__name__}")
        if got.shape != expected.shape:
            return self.expect(False, f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
        got32, expected32 = got.float(), expected.float()
        error = (got32 - expected32).abs()
        bound = atol + rtol * expected32.abs()
        ok = (error <= bound) & torch.isfinite(got32)
        if bool(ok.all()):
            return True
        bad = (~ok).nonzero()
        first = tuple(bad[0].tolist())
        return self.expect(False, f"{what}: {bad.size(0)} of {ok.numel()} elements off; first at {first}: got "
                                  f"{got32[first].item()!r}, expected {expected32[first].item()!r} "
                                  f"(bound {bound[first].item() if isinstance(bound, torch.Tensor) else bound:.3g})")

    @contextmanager
    def raises(self, exception_types, match: str, what: str):
        """The block must raise one of ``exception_types`` whose message contains ``match``."""
        try:
            yield
        except exception_types as error:
            self.expect(match in str(error), f"{what}: {type(error).__name__} does not mention {match!r}: {error}")
        except Exception as error:  # noqa: BLE001
            self.fail(f"{what}: raised {type(error).__name__} ({error}), expected {exception_types}")
        else:
            self.fail(f"{what}: did not raise {exception_types}")


def _int_of(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]


# ---------------------------------------------------------------------------------------- running a group
def _write_record(sections: Dict[str, List[str]], rank: int, out_dir: str) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    partial = f"{path}.{threading.get_ident()}.tmp"   # the watchdog's thread may write while the body's does
    with open(partial, "w") as file:
        json.dump(sections, file)
    os.replace(partial, path)


def _section_worker(rank: int, num_ranks: int, group, test_body: Callable, out_dir: str, body_kwargs: dict,
                    deadline_s: float) -> None:
    quiet_rank()
    recorder = Recorder(rank, write=lambda sections: _write_record(sections, rank, out_dir))

    def watchdog() -> None:
        # Ranks out of step can wait on each other for a long time: record it and end this process.
        section = recorder._current or "(outside any section)"
        recorder.sections.setdefault(section, []).append(
            f"the body did not finish within {deadline_s:g}s (ranks out of step?); it was in this section")
        try:
            _write_record(recorder.sections, rank, out_dir)
        finally:
            os._exit(3)

    timer = threading.Timer(deadline_s, watchdog)
    timer.daemon = True
    timer.start()
    try:
        test_body(rank, num_ranks, group, recorder, **body_kwargs)
    finally:
        timer.cancel()
        _write_record(recorder.sections, rank, out_dir)
        # Leaving the group waits for operations still pending after a failure; do not wait forever.
        exit_timer = threading.Timer(SHUTDOWN_SECONDS, os._exit, (4,))
        exit_timer.daemon = True
        exit_timer.start()


class SectionResults:
    def __init__(self, num_ranks: int, per_rank: Dict[int, Dict[str, List[str]]], crash: Optional[str]) -> None:
        self.num_ranks = num_ranks
        self.per_rank = per_rank
        self.crash = crash


def run_sections(num_ranks: int, body: Callable, deadline_s: float = BODY_DEADLINE_SECONDS, backend: str = "gloo",
                 **body_kwargs) -> SectionResults:
    """Run ``body(rank, num_ranks, group, recorder, **body_kwargs)`` on a fresh group (``backend``: gloo on CPU
    processes, nccl with one GPU per rank); collect each rank's record.
    A rank still running after ``deadline_s`` records that in its current section and exits."""
    with tempfile.TemporaryDirectory(prefix="uccl_ep_test_") as out_dir:
        crash = None
        try:
            run_ranks(num_ranks, _section_worker, backend=backend, test_body=body, out_dir=out_dir,
                      body_kwargs=body_kwargs, deadline_s=deadline_s)
        except AssertionError as error:
            crash = str(error)
        per_rank = {}
        for rank in range(num_ranks):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as file:
                    per_rank[rank] = json.load(file)
    return SectionResults(num_ranks, per_rank, crash)


def assert_section(results: SectionResults, section: str) -> None:
    """Fail if any rank did not run ``section`` or recorded a failure in it."""
    problems = []
    for rank in range(results.num_ranks):
        record = results.per_rank.get(rank)
        if record is None:
            problems.append(f"rank {rank} wrote no record")
        elif section not in record:
            problems.append(f"rank {rank} never ran section {section!r}")
        else:
            problems.extend(f"rank {rank}: {message}" for message in record[section])
    if problems:
        text = "\n".join(problems)
        if results.crash:
            text += "\n\nthe group failed:\n" + results.crash
        raise AssertionError(f"section {section!r} at {results.num_ranks} ranks:\n{text}")


class SectionCache:
    """Runs a body once per rank count (lazily, from whichever test asks first)."""

    def __init__(self, body: Callable, **body_kwargs) -> None:
        self.body = body
        self.body_kwargs = body_kwargs
        self._results: Dict[int, SectionResults] = {}

    def get(self, num_ranks: int) -> SectionResults:
        if num_ranks not in self._results:
            self._results[num_ranks] = run_sections(num_ranks, self.body, **self.body_kwargs)
        return self._results[num_ranks]


# ---------------------------------------------------------------------------------------- inputs
def generator(seed: int, rank: int = -1) -> torch.Generator:
    """A generator for ``(seed, rank)``; rank -1 gives the case-wide generator every rank shares."""
    return torch.Generator().manual_seed(1_000_003 * seed + 7919 * (rank + 1) + 17)


def randint(gen: torch.Generator, low: int, high: int) -> int:
    """Uniform integer in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (1,), generator=gen))


def choice(gen: torch.Generator, options: Sequence):
    return options[randint(gen, 0, len(options) - 1)]


def random_topk_idx(gen: torch.Generator, num_tokens: int, num_experts: int, num_topk: int,
                    drop_probability: float, unpicked: Sequence[int] = ()) -> torch.Tensor:
    """``[num_tokens, num_topk]`` int64 of distinct experts per token (as a router's top-k gives), experts in
    ``unpicked`` never chosen, and each entry replaced by -1 with ``drop_probability``."""
    scores = torch.rand((num_tokens, num_experts), generator=gen)
    if len(unpicked) > 0:
        scores[:, list(unpicked)] = -1.0
    topk_idx = torch.topk(scores, num_topk, dim=1).indices
    if len(unpicked) > 0 and num_tokens > 0:
        assert not torch.isin(topk_idx, torch.tensor(list(unpicked))).any(), "num_topk too large for unpicked"
    drop = torch.rand((num_tokens, num_topk), generator=gen) < drop_probability
    return torch.where(drop, torch.full_like(topk_idx, -1), topk_idx).to(torch.int64)


def random_weights(gen: torch.Generator, num_tokens: int, num_topk: int) -> torch.Tensor:
    """Positive float32 weights in ``[0.1, 1.1)``, never zero."""
    return torch.rand((num_tokens, num_topk), generator=gen) + 0.1


def random_bf16(gen: torch.Generator, shape: Tuple[int, ...], low: float, high: float) -> torch.Tensor:
    """bf16 values with magnitude in ``[low, high)`` and a random sign (never zero when ``low > 0``)."""
    magnitude = torch.rand(shape, generator=gen) * (high - low) + low
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (magnitude * sign).to(torch.bfloat16)


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist
    total = tensor.to(torch.int64).clone()
    dist.all_reduce(total, group=group)
    return total


def check_event(rec: "Recorder", event, what: str) -> None:
    """``event`` is an EventOverlap carrying a real event that can be waited on, also as a context manager."""
    from uccl_ep_plugin import EventOverlap
    if not rec.expect(isinstance(event, EventOverlap), f"{what}: got {type(event).__name__}, not an EventOverlap"):
        return
    rec.expect(event.event is not None, f"{what}: async_finish=True must return an event")
    event.current_stream_wait()
    with event:
        pass
