"""DeepEP's stream discipline for one operation.

The work runs on the Buffer's communication stream after ``previous_event`` (or after
everything already queued on the caller's stream). With ``async_finish`` the caller gets an
event to wait for; otherwise the caller's stream waits before the call returns. On CPU
every operation completes before it returns.

Outputs are allocated on the caller's stream, as DeepEP's are, when the caller's stream waits for
the communication stream before the call returns and the communication stream waited for all of the
caller's work: then nothing needs recording. Otherwise (``async_finish``, ``previous_event``,
``allocate_on_comm_stream``) the operation runs under the communication stream, so its allocations
and torch ops go there, and its outputs are recorded for the caller's stream.
"""

import functools
from contextlib import nullcontext
from typing import Callable, Iterable, Optional

import torch

from .event_overlap import NO_EVENT, EventHandle, EventOverlap


def _raw_stream_accessor():
    """torch's own accessor of the current stream's handle, about ten times cheaper than
    ``torch.cuda.current_stream(device).cuda_stream`` (the object it builds is not needed); that where a
    build lacks it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


_current_raw_stream = _raw_stream_accessor()


def current_stream_reader(device: torch.device) -> Callable[[], int]:
    """A function that returns the handle (an integer) of ``device``'s current CUDA stream, which kernels launch
    on (0 off CUDA); made once per Buffer or engine, so that a call pays no lookup beyond torch's own."""
    if device.type != "cuda":
        return _no_stream
    return functools.partial(_current_raw_stream, device.index)


def _no_stream() -> int:
    return 0


class CommStream:
    """A Buffer's communication stream, with the two events every operation hands work across on: the
    caller's stream to it and back. Reused call after call (a stream waits for an event's state when the
    wait is enqueued), which spares each operation creating and destroying two CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.handle = self.stream.cuda_stream   # what the native kernels launch on
        self.caller_ready = torch.cuda.Event()
        self.comm_done = torch.cuda.Event()


class StreamScope:
    def __init__(self, comm: Optional[CommStream], device: torch.device,
                 previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool) -> None:
        self.comm = comm
        self.device = device
        self.previous_event = previous_event
        self.async_finish = async_finish
        self.on_comm_stream = comm is not None and (async_finish or previous_event is not None or
                                                    allocate_on_comm_stream)
        self._compute_stream = None
        self._stream_context = None

    @property
    def launch_stream(self) -> int:
        """The stream the native kernels launch on (0 without a communication stream)."""
        return 0 if self.comm is None else self.comm.handle

    def on_launch_stream(self):
        """A context for torch ops whose results the native kernels read: they must run where the kernels do."""
        return torch.cuda.stream(self.comm.stream) if self.comm is not None and not self.on_comm_stream \
            else nullcontext()

    def __enter__(self) -> "StreamScope":
        previous = getattr(self.previous_event, "event", None)
        if self.comm is None:
            if previous is not None:
                previous.current_stream_wait()
            return self
        self._compute_stream = torch.cuda.current_stream(self.device)
        if previous is not None:
            previous.stream_wait(self.comm.stream)
        else:
            self.comm.caller_ready.record(self._compute_stream)
            self.comm.stream.wait_event(self.comm.caller_ready)
        if self.on_comm_stream:
            self._stream_context = torch.cuda.stream(self.comm.stream)
            self._stream_context.__enter__()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self._stream_context is not None:
            self._stream_context.__exit__(exc_type, exc_val, exc_tb)
            self._stream_context = None

    def run(self, operation: Callable, *arguments):
        """``operation(*arguments)`` inside this scope."""
        with self:
            return operation(*arguments)

    def finish(self, outputs: Iterable[Optional[torch.Tensor]] = (), extra_tensors: Optional[tuple] = None,
               inputs: Iterable[Optional[torch.Tensor]] = ()) -> EventOverlap:
        """Call after leaving the scope: hands ``outputs`` to the caller's stream and returns the event. With
        async_finish, the caller's ``inputs`` are kept from reuse until the communication stream's work ends
        (as DeepEP records them): the caller may free them before it waits for the event."""
        if self.comm is None:
            return EventOverlap(EventHandle(device=self.device), extra_tensors) if self.async_finish else NO_EVENT
        if self.on_comm_stream:
            _record(outputs, self._compute_stream)   # allocated on the communication stream, used on the caller's
        if self.async_finish:
            _record(inputs, self.comm.stream)
            return EventOverlap(EventHandle(stream=self.comm.stream, device=self.device), extra_tensors)
        self.comm.comm_done.record(self.comm.stream)
        self._compute_stream.wait_event(self.comm.comm_done)
        return NO_EVENT


def _record(tensors: Iterable[Optional[torch.Tensor]], stream) -> None:
    """Tell the caching allocator that ``stream`` uses these CUDA tensors."""
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cuda":
            tensor.record_stream(stream)
