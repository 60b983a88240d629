"""Events returned by every Buffer operation, with DeepEP's ``EventOverlap`` interface."""

from typing import Any, Optional, Tuple

import torch


class EventHandle:
    """A point on a stream that other streams can wait for.

    On CUDA it records a ``torch.cuda.Event`` on ``stream`` (default: the current stream).
    On CPU every operation has already finished when it returns, so the handle is complete
    from the start and waiting on it does nothing.
    """

    def __init__(self, stream: Optional[Any] = None, device: Optional[torch.device] = None) -> None:
        use_cuda = (device.type == "cuda") if device is not None else torch.cuda.is_available()
        self.event: Optional[torch.cuda.Event] = None
        if use_cuda:
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def stream_wait(self, stream: Any) -> None:
        """Make ``stream`` wait for this event (a no-op on CPU)."""
        if self.event is not None:
            stream.wait_event(self.event)


class EventOverlap:
    """Wraps an :class:`EventHandle` so compute can overlap communication.

    ``extra_tensors`` keeps tensors alive until the event is waited for, which replaces
    ``Tensor.record_stream`` inside CUDA graphs.
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event."""
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: this operation returned no event "
                               "(pass async_finish=True to get one)")
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


# What an operation without async_finish returns: no event, nothing kept. One object serves every such call (it
# holds no state); a new one per call cost a constructor call, about a tenth of a low-latency call's Python when
# cold.
NO_EVENT = EventOverlap()
