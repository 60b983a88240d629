"""DeepEP's stream discipline for one operation.

The work runs on the Buffer's communication stream after ``previous_event`` (or after
everything already queued on the caller's stream). With ``async_finish`` the caller gets an
event to wait for; otherwise the caller's stream waits before the call returns. On CPU
every operation completes before it returns.
"""

from typing import Iterable, Optional

import torch

from .event_overlap import EventHandle, EventOverlap


class StreamScope:
    def __init__(self, comm_stream: Optional["torch.cuda.Stream"], device: torch.device,
                 previous_event: Optional[EventOverlap], async_finish: bool) -> None:
        self.comm_stream = comm_stream
        self.device = device
        self.previous_event = previous_event
        self.async_finish = async_finish
        self._compute_stream = None
        self._stream_context = None

    def __enter__(self) -> "StreamScope":
        if self.comm_stream is not None:
            self._compute_stream = torch.cuda.current_stream(self.device)
            previous = getattr(self.previous_event, "event", None)
            if previous is not None:
                previous.stream_wait(self.comm_stream)
            else:
                self.comm_stream.wait_stream(self._compute_stream)
            self._stream_context = torch.cuda.stream(self.comm_stream)
            self._stream_context.__enter__()
        else:
            previous = getattr(self.previous_event, "event", None)
            if previous is not None:
                previous.current_stream_wait()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self._stream_context is not None:
            self._stream_context.__exit__(exc_type, exc_val, exc_tb)
            self._stream_context = None

    def finish(self, outputs: Iterable[Optional[torch.Tensor]] = (),
               extra_tensors: Optional[tuple] = None) -> EventOverlap:
        """Call after leaving the scope: hands ``outputs`` to the caller's stream and returns the event."""
        if self.comm_stream is None:
            return EventOverlap(EventHandle(device=self.device), extra_tensors) if self.async_finish else EventOverlap()
        for tensor in outputs:
            if tensor is not None and tensor.device.type == "cuda":
                # Allocated on the communication stream, used on the caller's.
                tensor.record_stream(self._compute_stream)
        if self.async_finish:
            return EventOverlap(EventHandle(stream=self.comm_stream, device=self.device), extra_tensors)
        self._compute_stream.wait_stream(self.comm_stream)
        return EventOverlap()
