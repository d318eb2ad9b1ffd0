"""KV events of kvtierd: vLLM 0.33-compatible ZMQ publishing and the ``/v1/events`` SSE feed.

:class:`EventHub` is what the daemon holds. Its pump task calls, every 20 ms or so::

    hub.publish(store.take_events(), {ns.ns_id: ns for ns in store.namespaces()})

and each call becomes one :class:`~kvtier_protocol.events.EventBatch` (``ts = time.time()``,
``data_parallel_rank = 0``) on the ZMQ PUB socket and one JSON-able dict per block event for every
SSE subscriber. Translation (hash units, token ids, placeholders) is in
:mod:`kvtier.daemon.server.event_translate`; sockets, the sender thread and replay in
:mod:`kvtier.daemon.server.event_zmq`. ``AllBlocksCleared`` is never sent: the store reports a clear
as one removal per block and tier, which is exact, and it has no "everything is gone" event.

A hub made with ``packed_endpoint`` also publishes every batch, with the same seq, on a second PUB
socket in kvtier's packed form (SPEC.md §9.8: token ids as little-endian u32 bins), for kvtier's
own subscribers (``decode_batch(..., packed=True)``); the vLLM-compatible socket is unchanged.

Nothing here blocks the event loop: the ZMQ side drops (and counts) batches when its queue is
full, and a subscriber whose queue is full loses events (counted per subscriber) without
slowing anyone else.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier_protocol.errors import InvalidRequest
from kvtier_protocol.events import make_topic
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.server.event_translate import BlockTokens, EventTranslator, Translated
from kvtier.daemon.server.event_zmq import WireBatch, ZmqPublisher, ZmqStats, endpoint_binds
from kvtier.daemon.store.stats import StoreEvent

__all__ = ["BlockTokens", "EventHub", "EventMetrics", "EventsSettings", "HubStats", "default_topic",
           "endpoint_binds"]

DATA_PARALLEL_RANK = 0
MAX_BATCH_EVENTS = 65_536  # receivers' default limit on events in one batch (SPEC.md §9.6)


class EventsSettings(Protocol):
    """What :class:`EventHub` reads from ``kvtier.daemon.config.EventsConfig``."""

    @property
    def endpoint(self) -> str | None: ...  # PUB endpoint; None: no ZMQ publisher
    @property
    def replay_endpoint(self) -> str | None: ...  # replay ROUTER (bound); None: no replay
    @property
    def topic(self) -> str: ...  # "" means default_topic()
    @property
    def legacy_array(self) -> bool: ...  # array-encoded events (vLLM before June 2026)
    @property
    def buffer_steps(self) -> int: ...  # batches kept for replay
    @property
    def hwm(self) -> int: ...  # SNDHWM of the PUB socket


class EventMetrics(Protocol):
    """The part of ``kvtier.daemon.server.metrics.Metrics`` the hub reports to."""

    def event_published(self, n: int = 1) -> None: ...


@dataclass(slots=True)
class HubStats:
    """Counters of the hub itself (the ZMQ sender has its own, :attr:`EventHub.zmq_stats`)."""

    batches: int = 0  # batches made (one per non-empty publish, more for huge ones)
    events: int = 0  # vLLM events in those batches
    sse_dropped: int = 0  # dicts lost by full subscriber queues, all subscribers together


def default_topic() -> str:
    """``kv@<hostname>@kvtier``: llm-d's ``kv@<pod>@<model>`` form with this host as the pod."""
    host = socket.gethostname().replace("@", "_") or "localhost"
    return make_topic(host, "kvtier")


class EventHub:
    """Publishes the store's block events to ZMQ subscribers (vLLM 0.33 format) and SSE clients.

    Args:
        cfg: the events settings (``kvtier.daemon.config.EventsConfig``).
        metrics: told how many events each publish sent.
        max_token_blocks: blocks whose tokens are remembered (:meth:`note_blocks`), LRU.
        max_token_ids: token ids remembered over all blocks (4 bytes each, typically).
        max_queue: batches waiting for the ZMQ sender thread before new ones are dropped.
        packed_endpoint: a second PUB endpoint carrying the same batches (same seq, same topic,
            no replay) in the packed form of SPEC.md §9.8, for kvtier's own subscribers; None:
            none. vLLM and llm-d cannot decode it: never point them at it.

    Raises:
        InvalidRequest: ``replay_endpoint`` without ``endpoint``.
    """

    def __init__(self, cfg: EventsSettings, metrics: EventMetrics | None = None, *,
                 max_token_blocks: int = 1_000_000, max_token_ids: int = 1 << 26,
                 max_queue: int = 10_000, packed_endpoint: str | None = None) -> None:
        if cfg.replay_endpoint is not None and cfg.endpoint is None:
            raise InvalidRequest("events.replay_endpoint needs events.endpoint (the PUB socket)")
        self.cfg = cfg
        self.metrics = metrics
        self.topic = cfg.topic or default_topic()
        self.stats = HubStats()
        self._translator = EventTranslator(max_token_blocks, max_token_ids)
        self._zmq: ZmqPublisher | None = None
        if cfg.endpoint is not None:
            self._zmq = ZmqPublisher(cfg.endpoint, replay_endpoint=cfg.replay_endpoint, topic=self.topic,
                                     legacy=cfg.legacy_array, buffer_steps=cfg.buffer_steps,
                                     hwm=cfg.hwm, max_queue=max_queue)
        self._packed: ZmqPublisher | None = None
        if packed_endpoint is not None:
            self._packed = ZmqPublisher(packed_endpoint, replay_endpoint=None, topic=self.topic, legacy=False,
                                        buffer_steps=0, hwm=cfg.hwm, max_queue=max_queue, packed=True)
        self._seq = 0  # next live seq, from 0 per publisher (vLLM)
        self._subscribers: dict[asyncio.Queue[dict[str, Any]], int] = {}  # queue -> events dropped

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Open the PUB socket (and the replay ROUTER, and the packed PUB socket); returns their
        endpoints in that order, [] without ZMQ.

        Raises:
            InvalidRequest: a malformed endpoint. Unavailable: an endpoint cannot be bound.
        """
        out = self._zmq.start() if self._zmq is not None else []
        if self._packed is not None:
            try:
                out += self._packed.start()
            except BaseException:
                self.close()
                raise
        return out

    def close(self) -> None:
        """Flush queued batches and close the sockets (waits at most a few seconds). Idempotent."""
        for z in (self._zmq, self._packed):
            if z is not None:
                z.close()

    @property
    def endpoints(self) -> list[str]:
        """The PUB endpoint, the replay endpoint and the packed endpoint as bound (after
        :meth:`start`), those configured."""
        z = self._zmq
        out = [] if z is None else [z.endpoint] + ([z.replay_endpoint] if z.replay_endpoint else [])
        return out + ([self._packed.endpoint] if self._packed is not None else [])

    @property
    def named_endpoints(self) -> list[tuple[str, str]]:
        """:attr:`endpoints` with what each is: ``events``, ``replay`` or ``packed``."""
        z = self._zmq
        out = [] if z is None else [("events", z.endpoint)] + ([("replay", z.replay_endpoint)] if z.replay_endpoint else [])
        return out + ([("packed", self._packed.endpoint)] if self._packed is not None else [])

    @property
    def packed_endpoint(self) -> str | None:
        """The packed PUB endpoint as bound (after :meth:`start`); None: none."""
        return self._packed.endpoint if self._packed is not None else None

    @property
    def zmq_stats(self) -> ZmqStats | None:
        return self._zmq.stats if self._zmq is not None else None

    @property
    def packed_stats(self) -> ZmqStats | None:
        """Counters of the packed publisher; None: none."""
        return self._packed.stats if self._packed is not None else None

    @property
    def token_info_blocks(self) -> int:
        """Blocks whose tokens are currently remembered."""
        return len(self._translator)

    # --- input ---------------------------------------------------------------------------------

    def note_blocks(self, ns_id: bytes, blocks: Sequence[BlockTokens]) -> None:
        """Remember the tokens of blocks just committed or put, so that their events carry them.

        Call it right after the commit, before the next :meth:`publish`. Malformed entries are
        skipped (their events become placeholders).
        """
        self._translator.note_blocks(ns_id, blocks)

    def publish(self, store_events: Sequence[StoreEvent], namespaces: Mapping[bytes, Namespace]) -> int:
        """Translate store events and send them as one batch (ZMQ) and as dicts (SSE).

        Args:
            store_events: from ``TieredStore.take_events()``, oldest first.
            namespaces: the registered namespaces by id (their ``hash_tokens``, ``block_tokens``
                and attention shape the events; an unknown namespace still publishes).

        Returns:
            vLLM events published: accepted by the ZMQ sender (the packed one when it is the
            only one), or, without an endpoint, made for SSE. 0 for no events, or when the
            sender is not running (before :meth:`start`, after :meth:`close`) or its queue was
            full; SSE subscribers get the events anyway.
        """
        if not store_events:
            return 0
        ts = time.time()
        legacy = self.cfg.legacy_array
        sent = 0
        for start in range(0, len(store_events), MAX_BATCH_EVENTS):
            chunk = store_events if len(store_events) <= MAX_BATCH_EVENTS else \
                store_events[start:start + MAX_BATCH_EVENTS]
            seq = self._seq
            self._seq += 1
            translated: list[Translated] | None = [] if self._subscribers else None  # per block, for SSE
            runs = self._translator.translate_runs(chunk, namespaces, per_block=translated)
            accepted = True  # without ZMQ, a batch is "sent" once made (SSE and metrics)
            if self._zmq is not None:  # False before start(), after close(), or queue full
                accepted = self._zmq.submit(seq, WireBatch(ts, [r.wire(legacy) for r in runs], DATA_PARALLEL_RANK))
            if self._packed is not None:
                packed = self._packed.submit(seq, WireBatch(ts, [r.packed() for r in runs], DATA_PARALLEL_RANK))
                accepted = packed if self._zmq is None else accepted
            if accepted:
                sent += len(runs)
                self.stats.batches += 1
                self.stats.events += len(runs)
            if translated:
                self._fan_out([t.as_dict(seq, ts) for t in translated])
        if sent and self.metrics is not None:
            self.metrics.event_published(sent)
        return sent

    # --- SSE -----------------------------------------------------------------------------------

    def subscribe(self, maxsize: int = 1000) -> asyncio.Queue[dict[str, Any]]:
        """A queue that receives one JSON-able dict per block event from now on.

        Each dict is the event's vLLM map form (``type``, ``block_hashes`` as u64, ``medium``,
        ``token_ids``, …) plus ``ns`` (hex), ``chain_hash`` and ``parent_hash`` (hex or None),
        ``tier`` (``gpu``/``host``/``disk``), ``num_tokens``, ``seq`` (the ZMQ batch) and ``ts``.
        Dicts are shared between subscribers: read, do not modify. When the queue is full new
        events are dropped for this subscriber only (see :meth:`dropped`).
        """
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize)
        self._subscribers[q] = 0
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        """Stop feeding ``q`` (unknown queues are ignored)."""
        self._subscribers.pop(q, None)

    def dropped(self, q: asyncio.Queue[dict[str, Any]]) -> int:
        """Events lost by subscriber ``q`` because its queue was full."""
        return self._subscribers.get(q, 0)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def _fan_out(self, dicts: list[dict[str, Any]]) -> None:
        for q in self._subscribers:
            for i, d in enumerate(dicts):
                try:
                    q.put_nowait(d)
                except asyncio.QueueFull:
                    lost = len(dicts) - i  # the rest of this batch cannot fit either
                    self._subscribers[q] += lost
                    self.stats.sse_dropped += lost
                    break
