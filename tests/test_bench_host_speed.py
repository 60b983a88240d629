"""The pure-Python loop `uccl-ep bench` times on every rank beside each case (benchmark/host_speed.py): it measures
the thread's own speed, so a thread that shares its core with a busy one takes longer."""

import threading

from uccl_ep_plugin.benchmark import host_speed


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_the_loop_takes_longer_when_another_thread_competes_for_the_interpreter():
    alone = host_speed.python_loop_us(additions=200000, repeats=3)
    assert alone > 0
    stop = threading.Event()
    other = threading.Thread(target=_spin, args=(stop,))
    other.start()
    try:
        shared = host_speed.python_loop_us(additions=200000, repeats=3)
    finally:
        stop.set()
        other.join()
    # The interpreter lock passes between the threads: the loop gets about half of it.
    assert shared > 1.3 * alone
