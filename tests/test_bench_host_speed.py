"""The pure-Python loop `uccl-ep bench` times on every rank beside each case (benchmark/host_speed.py): it measures
the thread's own speed, so a thread that shares its core with a busy one takes longer."""

import sys
import threading

from uccl_ep_plugin.benchmark import host_speed


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def _loop_us_beside_a_spinning_thread() -> float:
    stop = threading.Event()
    other = threading.Thread(target=_spin, args=(stop,))
    other.start()
    try:
        return host_speed.python_loop_us(additions=200000, repeats=3)
    finally:
        stop.set()
        other.join()


def test_the_loop_takes_longer_when_another_thread_competes_for_the_interpreter():
    # The interpreter lock changes hands often (every 5 ms by default, about half a loop), so each loop gets close
    # to half of it; alone and shared alternate, and the fastest run of each is compared: other load on the machine
    # only ever slows a run, so a burst of it that hits one kind more than the other cannot decide the comparison.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        alone, shared = [], []
        for _ in range(3):
            alone.append(host_speed.python_loop_us(additions=200000, repeats=3))
            shared.append(_loop_us_beside_a_spinning_thread())
    finally:
        sys.setswitchinterval(switch_interval)
    assert min(alone) > 0
    assert min(shared) > 1.3 * min(alone)
