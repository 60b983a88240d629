"""StreamScope's hand-off between the caller's stream and the Buffer's communication stream, played with
stand-in streams and events on CPU (the CUDA path otherwise runs only on GPU machines): the communication
stream waits for the caller's work, and without async_finish the caller's stream waits for the communication
stream before the call returns. A plain call allocates on the caller's stream and records nothing, as DeepEP's
does; with async_finish (or allocate_on_comm_stream) the call runs under the communication stream, its outputs
are recorded for the caller's stream and, with async_finish, the caller's inputs for the communication stream."""

import contextlib

import torch

from uccl_ep_plugin import streams


class _Log(list):
    def add(self, *entry):
        self.append(entry)


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.add("wait", self.name, event.name)


class _Event:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self, stream):
        self.log.add("record", self.name, stream.name)


class _Comm:
    def __init__(self, log):
        self.stream = _Stream("comm", log)
        self.handle = 1234
        self.caller_ready = _Event("caller_ready", log)
        self.comm_done = _Event("comm_done", log)


class _Output:
    device = torch.device("cuda", 0)

    def __init__(self, log):
        self.log = log

    def record_stream(self, stream):
        self.log.add("record_stream", stream.name)


def _scope(monkeypatch, log, async_finish, allocate_on_comm_stream=False):
    caller = _Stream("caller", log)
    monkeypatch.setattr(streams.torch.cuda, "current_stream", lambda device=None: caller)

    @contextlib.contextmanager
    def current(stream):
        log.add("enter", stream.name)
        yield
        log.add("leave", stream.name)
    monkeypatch.setattr(streams.torch.cuda, "stream", current)
    return streams.StreamScope(_Comm(log), torch.device("cuda", 0), None, async_finish, allocate_on_comm_stream)


def test_a_plain_call_allocates_on_the_callers_stream_and_records_nothing(monkeypatch):
    log = _Log()
    with _scope(monkeypatch, log, async_finish=False) as scope:
        log.add("work", scope.launch_stream)
    event = scope.finish([_Output(log), None], inputs=[_Output(log)])
    assert log == [("record", "caller_ready", "caller"), ("wait", "comm", "caller_ready"), ("work", 1234),
                   ("record", "comm_done", "comm"), ("wait", "caller", "comm_done")]
    assert event.event is None


def test_allocate_on_comm_stream_runs_under_it_and_hands_the_outputs_over(monkeypatch):
    log = _Log()
    with _scope(monkeypatch, log, async_finish=False, allocate_on_comm_stream=True) as scope:
        log.add("work")
    scope.finish([_Output(log), None], inputs=[_Output(log)])   # the caller waits: inputs not recorded
    assert log == [("record", "caller_ready", "caller"), ("wait", "comm", "caller_ready"), ("enter", "comm"),
                   ("work",), ("leave", "comm"), ("record_stream", "caller"), ("record", "comm_done", "comm"),
                   ("wait", "caller", "comm_done")]


def test_async_finish_hands_back_an_event_on_the_communication_stream(monkeypatch):
    log = _Log()
    recorded = []
    monkeypatch.setattr(streams, "EventHandle", lambda stream, device: recorded.append(stream.name) or "handle")
    with _scope(monkeypatch, log, async_finish=True) as scope:
        log.add("work")
    scope.finish([_Output(log)], inputs=[_Output(log), None])
    assert recorded == ["comm"]
    # The output is the caller's to use; the input must outlive the communication stream's reads of it.
    assert ("enter", "comm") in log and ("wait", "caller", "comm_done") not in log
    assert log[-2:] == [("record_stream", "caller"), ("record_stream", "comm")]
