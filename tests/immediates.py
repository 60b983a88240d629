"""Collecting a transport's immediates in the transport tests: each expected one exactly once, none
unexpected, and a check run the moment each arrives (that its bytes had landed)."""

import time
from typing import Callable, Dict, List, Optional, Set, Tuple


def collect_immediates(transport, rank: int, wanted: Set[Tuple[int, int]], timeout_s: float,
                       on_arrival: Callable[[int, int], None],
                       while_waiting: Optional[Callable[[], None]] = None) -> Dict[int, List[int]]:
    """Polls until every ``(src, imm)`` of ``wanted`` arrived; returns each source's immediates in arrival
    order. ``while_waiting()`` runs on every poll (e.g. to drain completions)."""
    got: Set[Tuple[int, int]] = set()
    seen: Dict[int, List[int]] = {src: [] for src, _ in wanted}
    deadline = time.monotonic() + timeout_s
    while got != wanted:
        assert time.monotonic() < deadline, f"rank {rank}: immediates missing: {sorted(wanted - got)[:10]}"
        if while_waiting is not None:
            while_waiting()
        events = transport.poll_immediates()
        if not events:
            time.sleep(0.0005)
        for src, imm in events:
            assert (src, imm) in wanted, f"rank {rank}: unexpected immediate {(src, imm)}"
            assert (src, imm) not in got, f"rank {rank}: immediate {(src, imm)} delivered twice"
            got.add((src, imm))
            seen[src].append(imm)
            on_arrival(src, imm)
    return seen
