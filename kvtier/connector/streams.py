"""Streams and events for the connector's layer-wise copies: the ordering rules of a GPU, and the
same code on a host.

Three streams take part in a layer-wise transfer::

    compute (the engine's)   ... layer i writes pages ──record──► ev ─────────────┐
    save                      wait(ev) ──► copy layer i of the pages to staging ◄─┘ ──record──► read
    load                      wait(compute so far, earlier saves' reads) ──► copy layer i to pages
                              ──record──► ready_i ──► compute waits ready_i before layer i

* A load writes pages only after the compute already queued (which may still read those pages)
  and after every earlier save has read them; the compute stream waits for layer i's copy before
  layer i runs.
* A save reads layer i of its pages only after the compute that wrote them (an event recorded on
  the compute stream); the engine's compute waits for the save's "read" event before it writes
  those pages again, so a page is never reused while a save still reads it.

On CUDA (:func:`cuda_streams`) the copies run on two dedicated streams and every wait is a GPU
wait (the host does not block). On a host (:func:`host_streams`) every stream is synchronous: an
op runs when it is queued and every event is complete when recorded, so the same code runs, in
order, without a GPU. Tests plug in a stream clock of their own (any :class:`Stream`) to check
that the waits are where they must be.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class Event(Protocol):
    """A point in a stream's work."""

    def query(self) -> bool:
        """Whether the work before the event has finished."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until the work before the event has finished."""
        ...


class Stream(Protocol):
    """An ordered queue of device work."""

    def run(self, fn: Callable[[], None]) -> None:
        """Queue the device work that ``fn`` issues (copies) on this stream."""
        ...

    def wait_event(self, event: Event) -> None:
        """Work queued on this stream from now on starts after ``event``."""
        ...

    def record_event(self) -> Event:
        """An event that completes when the work queued on this stream so far has finished."""
        ...


class DoneEvent:
    """An event that is complete when made (the work before it ran synchronously)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = DoneEvent()


class HostStream:
    """A synchronous stream: ``run`` runs ``fn`` now, in the caller's thread; waits block."""

    def run(self, fn: Callable[[], None]) -> None:
        fn()

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def record_event(self) -> Event:
        return DONE


class CudaStream:
    """A CUDA stream (a dedicated one, or None for the calling thread's current stream at each call).

    Args:
        device: the CUDA device.
        stream: the stream; None: ``torch.cuda.current_stream(device)`` whenever it is used (the
            engine's compute stream, which an engine may change between steps).
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self.device = device
        self._stream = stream

    @property
    def stream(self) -> torch.cuda.Stream:
        return self._stream if self._stream is not None else torch.cuda.current_stream(self.device)

    def run(self, fn: Callable[[], None]) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            fn()

    def wait_event(self, event: Event) -> None:
        if isinstance(event, torch.cuda.Event):
            self.stream.wait_event(event)
        else:  # a host-side event (DONE, a test's clock): the host waits for it
            event.synchronize()

    def record_event(self) -> Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


@dataclass(frozen=True, slots=True)
class Streams:
    """The three streams of a connector's layer-wise copies.

    Attributes:
        compute: the engine's stream (work recorded on it from the engine's thread).
        load: host→device copies of loads.
        save: device→host copies of saves.
    """

    compute: Stream
    load: Stream
    save: Stream

    @property
    def on_cuda(self) -> bool:
        """Whether the copies run on CUDA streams (staging is then pinned)."""
        return isinstance(self.load, CudaStream)


def host_streams() -> Streams:
    """Synchronous streams: every copy runs when queued, every event is complete."""
    return Streams(HostStream(), HostStream(), HostStream())


def cuda_streams(device: torch.device) -> Streams:
    """The device's current stream for compute, two dedicated streams for loads and saves."""
    return Streams(CudaStream(device), CudaStream(device, torch.cuda.Stream(device)),
                   CudaStream(device, torch.cuda.Stream(device)))


def streams_for(device: torch.device | str) -> Streams:
    """CUDA streams for a CUDA device, synchronous host streams for anything else."""
    device = torch.device(device)
    return cuda_streams(device) if device.type == "cuda" else host_streams()


class Staging:
    """Host buffers for layer-wise copies, pinned (page-locked) once when the copies run on CUDA.

    Buffers are handed out and given back: a buffer is reused only after the copies that used it
    ended (the user gives it back with the event after its last copy, synchronized before reuse),
    and pinned memory is allocated only when no free buffer is large enough — so a steady stream
    of loads and saves registers its memory once.

    Args:
        pinned: pin the buffers (CUDA copies); False: ordinary host memory.
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._free: list[tuple[torch.Tensor, Event]] = []
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` bytes, free for the caller until :meth:`give_back`."""
        with self._lock:
            fits = [i for i, (buf, _) in enumerate(self._free) if buf.numel() >= nbytes]
            if fits:
                buf, last = self._free.pop(min(fits, key=lambda i: self._free[i][0].numel()))
            else:
                buf, last = None, DONE
        if buf is None:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pinned)
            with self._lock:
                self.allocated_bytes += buf.numel()
        last.synchronize()  # the copies of its last user have ended
        return buf

    def give_back(self, buf: torch.Tensor, last: Event = DONE) -> None:
        """Return ``buf``; its next user waits for ``last`` (the event after its last copy)."""
        with self._lock:
            self._free.append((buf, last))


def typed(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The first bytes of a uint8 buffer as a contiguous ``dtype`` tensor of ``shape``."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return buf[:n].view(dtype).view(shape)
