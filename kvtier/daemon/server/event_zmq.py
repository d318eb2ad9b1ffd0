"""The ZMQ side of KV events: a PUB socket and an optional replay ROUTER (SPEC.md §9.4).

Byte-compatible with vLLM 0.33's ``ZmqEventPublisher``::

    asyncio loop                         sender thread (owns every socket)
    ------------                         ---------------------------------
    submit(seq, batch) ─► queue ─wake─►  msgpack     ─► PUB    [topic, seq u64 BE, payload]
      (full: drop, count)                     └────────► replay buffer (last buffer_steps)
                                         ROUTER ◄─ [id, b"", start]   DEALER
                                                ─► [id, b"", topic, seq, payload] per seq >= start
                                                ─► [id, b"", b"", ff*8, b""]   end marker

Why a thread rather than ``zmq.asyncio``: the replay ROUTER must answer while the loop is busy
with the data plane, encoding a large batch must not stall request handling, and ZMQ sockets are
not thread-safe, so one thread owns both sockets and the loop only touches a bounded
``queue.Queue`` plus a non-blocking wake-up pipe (the thread sleeps in ``zmq.Poller`` on the
ROUTER and the pipe, so an idle daemon does not spin). Nothing on the loop side ever waits: a
full queue drops the batch and counts it, and PUB drops at its HWM rather than block.

Endpoint rule (vLLM's, plus loopback): the PUB socket **binds** when the address contains ``*``
or ``::``, is ``ipc://`` or ``inproc://``, or is ``tcp://`` to a numeric loopback address
(127.0.0.0/8), because a daemon's local endpoint is a listener; it **connects** otherwise, so
the daemon can push to a subscriber that binds (use ``tcp://localhost:PORT`` to connect to a
local one). The replay ROUTER always binds, as in vLLM.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq
from kvtier_protocol.errors import EventError, InvalidRequest, Unavailable
from kvtier_protocol.events import (EventBatch, encode_batch, encode_wire_batch, live_message,
                                    parse_replay_request, replay_end, replay_reply)

log = logging.getLogger(__name__)

PUB_LINGER_MS = 1000  # at close, give queued messages this long to leave
JOIN_TIMEOUT_S = 5.0


def endpoint_binds(endpoint: str) -> bool:
    """Whether the PUB socket binds ``endpoint`` (True) or connects to it (False)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rpartition(":")[0]
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False  # a host name: connect, like vLLM
    return False


@dataclass(slots=True)
class ZmqStats:
    """Counters of the sender; each field has a single writer (the loop or the thread)."""

    batches_sent: int = 0  # live messages handed to the PUB socket (thread)
    queue_dropped: int = 0  # batches dropped because the sender queue was full (loop)
    send_dropped: int = 0  # batches the PUB socket refused without blocking (thread)
    send_errors: int = 0  # batches that failed to encode or send (thread; logged)
    replay_requests: int = 0  # well-formed replay requests answered (thread)
    replay_bad: int = 0  # replay requests of the wrong shape, ignored (thread)
    replayed: int = 0  # batches sent again through replay (thread)


@dataclass(frozen=True, slots=True)
class WireBatch:
    """A batch whose events are already in wire form (``EventTranslator.translate_wire`` with
    the publisher's ``legacy`` setting): the sender thread only packs it."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _encode(batch: EventBatch | WireBatch, legacy: bool, packed: bool) -> bytes:
    if isinstance(batch, WireBatch):
        return encode_wire_batch(batch.ts, batch.events, batch.data_parallel_rank)
    return encode_batch(batch, legacy=legacy, packed=packed)


def _open(ctx: zmq.Context, kind: int, endpoint: str, bind: bool, hwm: int, linger: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.LINGER, linger)
        if bind:
            sock.bind(endpoint)
            return sock
        sock.connect(endpoint)
        return sock
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        err = InvalidRequest if exc.errno in (errno.EINVAL, errno.EPROTONOSUPPORT) else Unavailable
        raise err(f"KV events: cannot {'bind' if bind else 'connect'} {endpoint!r}: {exc}") from exc


class ZmqPublisher:
    """PUB (+ replay ROUTER) behind a sender thread.

    Args:
        endpoint: the PUB endpoint (bound or connected per :func:`endpoint_binds`).
        replay_endpoint: where the replay ROUTER binds; None: no replay.
        topic: frame 0 of every message.
        legacy: encode events as arrays (vLLM before June 2026) instead of maps.
        buffer_steps: batches the replay buffer keeps.
        hwm: SNDHWM of the PUB socket.
        max_queue: batches waiting for the thread before new ones are dropped.
        packed: this socket carries kvtier's packed form (SPEC.md §9.8); :class:`WireBatch`
            events come already packed (``Run.packed``), :class:`EventBatch` ones are packed here.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None, topic: str, legacy: bool,
                 buffer_steps: int, hwm: int, max_queue: int, packed: bool = False) -> None:
        if packed and legacy:
            raise InvalidRequest("the packed event form is a map form; it has no legacy variant")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._legacy = legacy
        self._packed = packed
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(buffer_steps, 0))
        # max(…, 1): a maxsize of 0 would make the queue unbounded
        self._queue: queue.Queue[tuple[int, EventBatch | WireBatch]] = queue.Queue(max(max_queue, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._wake_r = self._wake_w = -1
        self.stats = ZmqStats()

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def start(self) -> list[str]:
        """Open the sockets and start the sender thread; returns the endpoints (bound ones as
        ZMQ resolved them, e.g. a ``*`` port replaced by the real one).

        Raises:
            InvalidRequest: a malformed endpoint. Unavailable: it cannot be bound (in use).
        """
        assert self._ctx is None, "a ZmqPublisher starts once"
        self._ctx = zmq.Context()
        try:
            bind = endpoint_binds(self.endpoint)
            self._pub = _open(self._ctx, zmq.PUB, self.endpoint, bind, self._hwm, PUB_LINGER_MS)
            if bind:
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint is not None:
                # vLLM's sizing: a full replay plus its end marker, twice, fits without dropping.
                hwm = 2 * (self._buffer.maxlen + 1) if self._buffer.maxlen else 2
                self._router = _open(self._ctx, zmq.ROUTER, self.replay_endpoint, True, hwm, 0)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_sockets()
            self._ctx.term()
            self._ctx = None
            raise
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # The sockets were made here; from now on only the thread touches them (thread start is
        # the memory barrier ZMQ asks for when a socket changes threads).
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()
        return [self.endpoint] + ([self.replay_endpoint] if self.replay_endpoint else [])

    def submit(self, seq: int, batch: EventBatch | WireBatch) -> bool:
        """Queue one batch for sending; never blocks. False: dropped (queue full or closed).
        A :class:`WireBatch` must be in this publisher's encoding (``legacy``, ``packed``)."""
        if not self.running:
            return False
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.stats.queue_dropped += 1
            return False
        self._wake()
        return True

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread will look at the queue

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("KV event sender did not stop within %.0f s; leaving its sockets", JOIN_TIMEOUT_S)
        else:
            assert self._ctx is not None
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._thread = None

    # --- sender thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                self._drain_wake()
                self._send_queued()
                if self._router is not None and ready.get(self._router):
                    self._serve_replay()
                if self._stop.is_set():
                    self._send_queued()  # whatever was submitted before close()
                    return
        except zmq.ZMQError:
            log.exception("KV event sender stopped")
        finally:
            self._close_sockets()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _send_queued(self) -> None:
        assert self._pub is not None
        while True:
            try:
                seq, batch = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                payload = _encode(batch, self._legacy, self._packed)
                self._pub.send_multipart(live_message(self._topic, seq, payload), flags=zmq.NOBLOCK)
                self.stats.batches_sent += 1
            except zmq.Again:
                self.stats.send_dropped += 1
            except (EventError, TypeError, ValueError, zmq.ZMQError):
                self.stats.send_errors += 1
                log.exception("KV event batch %d not sent", seq)
                continue
            self._buffer.append((seq, payload))  # replay can still deliver a dropped send

    def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, start = parse_replay_request(frames)
            except EventError:
                self.stats.replay_bad += 1
                continue
            self.stats.replay_requests += 1
            try:
                for seq, payload in self._buffer:
                    if seq >= start:
                        self._router.send_multipart(replay_reply(identity, self._topic, seq, payload),
                                                    flags=zmq.NOBLOCK)
                        self.stats.replayed += 1
                self._router.send_multipart(replay_end(identity), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("KV event replay to a slow client cut short")  # it will ask again

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close()
        self._pub = self._router = None
