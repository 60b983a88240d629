"""Counting this process's open file descriptors and threads, to show that close()/stop() leak nothing."""

import os
import time
from typing import Tuple


def fds_and_threads() -> Tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def settled_fds_and_threads(expected: Tuple[int, int], timeout: float = 2.0) -> Tuple[int, int]:
    """The (fds, threads) counts once they equal ``expected``, or as they are after ``timeout``: a joined
    thread can still be listed for a moment while the OS thread exits."""
    deadline = time.monotonic() + timeout
    while True:
        counts = fds_and_threads()
        if counts == expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.01)
