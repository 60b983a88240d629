"""The native low-latency engine turns a kernel's recorded failure (code, phase, peer, detail in host-mapped
memory) into an exception naming this rank, the operation and phase, and the rank waited for. The kernels
themselves are covered on GPUs (tests/test_gpu_low_latency.py); this checks the wording for every phase."""

import pytest

from uccl_ep_plugin.engines.native.low_latency import NativeLowLatency
from uccl_ep_plugin.engines.reference.collectives import CommTimeoutError

TIMEOUT, TOO_MANY_ROWS, PROXY_STALLED = 1, 2, 3


class RecordedStatus:
    def __init__(self, code, phase, peer, detail):
        self.record = (code, phase, peer, detail)

    def status(self):
        return self.record


def engine_with(code, phase, peer, detail):
    engine = object.__new__(NativeLowLatency)   # no buffers: check() reads only the recorded status
    engine.proxy_path = None
    engine.state = RecordedStatus(code, phase, peer, detail)
    engine.rank = 0
    engine.timeout_s = 3.0
    return engine


@pytest.mark.parametrize("phase, operation, detail, wording", [
    (1, "low_latency_dispatch (receive)", 5, "local expert 5"),
    (2, "low_latency_combine (receive)", 170, "expert 170"),
    (3, "low_latency_dispatch (send)", -1, "to finish reading this buffer half"),
    (4, "low_latency_combine (send)", -1, "to finish reading this buffer half"),
    (6, "low_latency_combine (send, pre-reduced)", 9, "for the routing of its tokens"),
])
def test_timeout_names_rank_phase_and_peer(phase, operation, detail, wording):
    with pytest.raises(CommTimeoutError) as error:
        engine_with(TIMEOUT, phase, 1, detail).check()
    message = str(error.value)
    for needed in ("rank 0", operation, "waiting for rank 1", wording, "3 s"):
        assert needed in message, f"{needed!r} missing from: {message}"


def test_no_failure_raises_nothing():
    engine_with(0, 0, 0, 0).check()


def test_too_many_rows_and_stalled_proxy():
    with pytest.raises(ValueError, match="names expert 12 more often"):
        engine_with(TOO_MANY_ROWS, 3, 1, 12).check()
    with pytest.raises(CommTimeoutError, match="proxy FIFO for rank 1"):
        engine_with(PROXY_STALLED, 4, 1, 0).check()
