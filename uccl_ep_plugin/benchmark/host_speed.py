"""How fast a rank's host core runs Python, printed beside each case's host figures.

The lent GPU machines are virtual: the same pure-Python loop takes twice as long in one rank's process as in
another's on the same machine, pinned or not, and can change speed within a run. A call's host time follows, so
two host figures compare only at similar loop times."""

import statistics
import time

LOOP_ADDITIONS = 20000
LOOP_REPEATS = 7


def python_loop_us(additions: int = LOOP_ADDITIONS, repeats: int = LOOP_REPEATS) -> float:
    """Median microseconds this thread takes for a fixed loop of integer additions (no allocation, no calls)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for value in range(additions):
            total += value
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)
