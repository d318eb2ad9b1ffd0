"""Layer-wise loads and saves of the connector core: a load consumed layer by layer while the engine
computes, a save fed layer by layer as the engine's layers finish.

Records stay whole blocks on the store side; the per-layer view is the layer axis of the block
(every page layout stacks the layers first, ``[L, *page]``), so layer ``i`` of a record is the
``i``-th of ``L`` equal slices of its payload.

**When a loaded layer is released.** A record's checksum covers its whole payload, so no part of
it is trusted before all of it is in and verified. A load therefore runs in two phases:

1. every record of the load is fetched and verified (and, if stored in another layout or codec,
   decoded); this fixes how many blocks load (:meth:`LayerLoad.num_blocks`: consecutive from the
   first, fewer at a miss or bad block), before the engine builds the step that computes the rest;
2. layer by layer, that layer's slice of every verified block is copied into the pages (on the
   load stream) and the layer is released: :meth:`LayerLoad.wait_layer` returns once layer ``i``'s
   copy is queued and makes the engine's compute wait for it. Layer ``i + 1`` is copied while the
   engine computes layer ``i``.

On a host with synchronous streams (:func:`kvtier.connector.streams.host_streams`, CPU caches)
phase 1 runs in the caller's thread (:meth:`KVConnectorCore.start_load`) and phase 2 in the
consumer's: :meth:`LayerLoad.wait_layer` places layer ``i`` when the
engine reaches it. A copy on another thread would compete with the engine's compute for the
cores and the GIL (which made a partial hit slower, not faster, on a loaded 2-core host), and a
host's copies are not asynchronous anyway; the overlap is a GPU's, whose copy engines run beside
its compute. Any other stream (a CUDA stream, a test's) gets phase 2 on the load thread.

A save copies layer ``i`` of its pages to host staging once the compute that wrote them is done
(:meth:`LayerSave.layer_done`, ordered by an event on the compute stream); after the last layer,
the blocks are encoded and stored on the core's job thread, as :meth:`KVConnectorCore.submit_save`
does. See :mod:`kvtier.connector.streams` for the ordering rules.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.connector.blocks import decode_stacked, kv_dtype, raw_payload
from kvtier.connector.jobs import JobResult
from kvtier.connector.pages import PageLayout
from kvtier.connector.streams import DONE, DoneEvent, Event, HostStream, Staging, Stream, Streams, typed
from kvtier.connector.transfer import Transfer, _bad_block
from kvtier_protocol.layouts import convert_many


class LayerLoad:
    """A load that the engine consumes layer by layer (see the module docstring).

    The load runs on the connector's load thread; the engine calls :meth:`num_blocks` before it
    builds the step, :meth:`wait_layer` before each layer reads the cache, and :meth:`result`
    after the step.

    Attributes:
        asked: blocks asked for.
        trace: ``("ready", i)`` when layer ``i`` is released, ``("wait", i)`` when the engine
            reaches layer ``i`` before it is released, ``("consumed", i)`` when the engine goes on
            with layer ``i``, in the order they happened.
    """

    def __init__(self, num_layers: int, asked: int) -> None:
        self.asked = asked
        self.num_layers = num_layers
        self.trace: list[tuple[str, int]] = []
        self._cond = threading.Condition()
        self._count: int | None = None
        self._error: str | None = None
        self._ready: list[Event | None] = [None] * num_layers
        self._waiting: int | None = None
        self._placers: list[Callable[[], None]] | None = None  # phase 2 left to the consumer
        self._placing = threading.Lock()

    def _defer(self, placers: list[Callable[[], None]]) -> None:
        """Leave phase 2 to the consumer: ``placers[i]()`` places layer ``i`` (in its thread)."""
        with self._cond:
            self._placers = placers
            self._cond.notify_all()

    def _place_through(self, layer: int) -> None:
        """Place every layer up to ``layer`` not placed yet, in this thread (deferred loads)."""
        with self._placing:
            for i in range(layer + 1):
                with self._cond:
                    if self._ready[i] is not None:
                        continue
                    placers = self._placers
                assert placers is not None
                placers[i]()
                self._release(i, DONE)

    # -- the load thread ---------------------------------------------------------------------------

    def _announce(self, count: int, error: str | None) -> None:
        with self._cond:
            self._count, self._error = count, error
            self._cond.notify_all()

    def _release(self, layer: int, event: Event) -> None:
        with self._cond:
            self._ready[layer] = event
            self.trace.append(("ready", layer))
            self._cond.notify_all()

    def _fail(self, why: str) -> None:
        """The load broke off (an unexpected error): nothing of it counts, every layer is released
        so the engine never blocks on it, and :meth:`result` reports no block loaded."""
        with self._cond:
            if self._count is None:
                self._count = 0
            self._error = why
            self._failed = True
            for i, ev in enumerate(self._ready):
                if ev is None:
                    self._ready[i] = DONE
            self._cond.notify_all()

    _failed = False

    # -- the engine ---------------------------------------------------------------------------------

    @property
    def waiting(self) -> int | None:
        """The layer the engine is blocked on now, or None."""
        with self._cond:
            return self._waiting

    def num_blocks(self, timeout_s: float | None = None) -> int:
        """Blocks that will load, consecutive from the first: known once every record is verified.

        Raises:
            TimeoutError: not known within ``timeout_s``.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._count is not None, timeout_s):
                raise TimeoutError(f"layer-wise load: records not verified within {timeout_s} s")
            assert self._count is not None
            return self._count

    def wait_layer(self, layer: int, compute: Stream, timeout_s: float | None = None) -> None:
        """Return when layer ``layer``'s bytes are in place (queued before the compute's next work).

        Raises:
            TimeoutError: the layer was not released within ``timeout_s``.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._count is not None, timeout_s)
            deferred = self._placers is not None
        if deferred:
            self._place_through(layer)
        with self._cond:
            if self._ready[layer] is None:
                self.trace.append(("wait", layer))
                self._waiting = layer
                self._cond.notify_all()
                ok = self._cond.wait_for(lambda: self._ready[layer] is not None, timeout_s)
                self._waiting = None
                if not ok:
                    raise TimeoutError(f"layer-wise load: layer {layer} not in place within {timeout_s} s")
            event = self._ready[layer]
        assert event is not None
        compute.wait_event(event)
        with self._cond:
            self.trace.append(("consumed", layer))

    def wait_waiting(self, layer: int, timeout_s: float | None = None) -> bool:
        """Block until the engine is blocked on ``layer`` (for tests and diagnostics); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting == layer, timeout_s)

    def result(self, timeout_s: float | None = None) -> JobResult:
        """Block until every layer is in place; how the load ended (``job`` is 0).

        Raises:
            TimeoutError: not every layer was in place within ``timeout_s``.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._count is not None, timeout_s)
            deferred = self._placers is not None
        if deferred:
            self._place_through(self.num_layers - 1)
        with self._cond:
            if not self._cond.wait_for(lambda: all(e is not None for e in self._ready), timeout_s):
                raise TimeoutError(f"layer-wise load not in place within {timeout_s} s")
            count = 0 if self._failed else (self._count or 0)
            return JobResult(0, self._error is None and count == self.asked, count, self._error)


def run_load(load: LayerLoad, transfer: Transfer, keys: list[bytes], caches: Sequence[torch.Tensor],
             views: list[np.ndarray] | None, index: torch.Tensor, layout: PageLayout, shape: tuple[int, ...],
             streams: Streams, staging: Staging, after: Sequence[Event]) -> None:
    """The body of a layer-wise load (on the load thread); see :class:`LayerLoad`."""
    try:
        _load(load, transfer, keys, caches, views, index, layout, shape, streams, staging, after)
    except Exception as exc:
        load._fail(f"{type(exc).__name__}: {exc}")
        raise


def _load(load: LayerLoad, transfer: Transfer, keys: list[bytes], caches: Sequence[torch.Tensor],
          views: list[np.ndarray] | None, index: torch.Tensor, layout: PageLayout, shape: tuple[int, ...],
          streams: Streams, staging: Staging, after: Sequence[Event]) -> None:
    ns = transfer.ns
    dtype = kv_dtype(ns)
    device = caches[0].device
    # Raw payloads of the pages' own layout are copied as bytes: straight into CPU pages, or into
    # pinned staging for a device. Anything else is decoded on the host (then staged).
    as_bytes = views is not None or device.type != "cpu"
    # Phase 1: every record in and verified, decoded where needed: the count is then fixed.
    records: list[bytes] = []
    error = None
    for lo in range(0, len(keys), transfer.batch_blocks):
        chunk = keys[lo:lo + transfer.batch_blocks]
        got, error = transfer.records(chunk)
        records += got
        if error is None and len(got) < len(chunk):
            error = f"miss at block {lo + len(got)} of {len(keys)}"
        if error is not None:
            break
    raw: list[tuple[int, memoryview]] = []
    todo: list[tuple[int, bytes]] = []
    for at, record in enumerate(records):
        payload = raw_payload(record, layout=layout.block_layout, shape=shape, dtype=ns.kv_dtype) if as_bytes else None
        if payload is not None:
            raw.append((at, payload))
        else:
            todo.append((at, record))
    decoded, bad, why = decode_stacked(ns, todo, dtype, "cpu")
    count = len(records)
    if bad is not None:  # nothing from the first bad block on reaches the pages
        error, count = _bad_block(bad, why), bad
    raw = [(at, p) for at, p in raw if at < count]
    groups = [(at, convert_many(blocks, src, layout.block_layout, contiguous=False))
              for src, (at, blocks) in decoded.items()]
    load._announce(count, error)
    transfer.stats.add(loaded_blocks=count)
    if count == 0:
        for i in range(len(caches)):
            load._release(i, DONE)
        return
    # Phase 2: layer by layer, after the compute queued so far and earlier saves' reads.
    for event in after:
        streams.load.wait_event(event)
    axis = layout.page_axis
    if device.type == "cpu":
        pages = index.tolist()
        if isinstance(streams.load, HostStream) and all(isinstance(e, DoneEvent) for e in after):
            load._defer([functools.partial(_place_host, i, cache, views, pages, index, raw, groups, axis)
                         for i, cache in enumerate(caches)])
            return
        for i, cache in enumerate(caches):
            streams.load.run(lambda i=i, cache=cache: _place_host(i, cache, views, pages, index, raw, groups, axis))
            load._release(i, streams.load.record_event())
        return
    page = shape[1:]
    buf = staging.take(len(caches) * count * math.prod(page) * dtype.itemsize)
    stage = typed(buf, dtype, (len(caches), count, *page))
    rows = stage.view(torch.uint8).view(len(caches), count, -1).numpy()
    last: Event = DONE
    try:
        for i, cache in enumerate(caches):
            for at, payload in raw:  # host copies into pinned memory, then one DMA per layer
                rows[i, at] = np.frombuffer(payload, dtype=np.uint8).reshape(len(caches), -1)[i]
            for at, blocks in groups:
                stage[i, torch.tensor(at)] = blocks[:, i]
            streams.load.run(lambda i=i, cache=cache: cache.index_copy_(
                axis, index[:count], stage[i].to(device, non_blocking=True).movedim(0, axis)))
            last = streams.load.record_event()
            load._release(i, last)
    finally:
        staging.give_back(buf, last)


def _place_host(layer: int, cache: torch.Tensor, views: list[np.ndarray] | None, pages: list[int],
                index: torch.Tensor, raw: list[tuple[int, memoryview]],
                groups: list[tuple[list[int], torch.Tensor]], axis: int) -> None:
    """Layer ``layer`` of the verified blocks into CPU pages: raw bytes straight from the records."""
    if raw:
        assert views is not None, "raw payloads are copied as bytes only into viewable CPU caches"
        view = views[layer]
        page = view.shape[:axis] + view.shape[axis + 1:]
        for at, payload in raw:
            src = np.frombuffer(payload, dtype=np.uint8).reshape(len(views), *page)[layer]
            np.copyto(view[(slice(None),) * axis + (pages[at],)], src)
    for at, blocks in groups:
        cache.index_copy_(axis, index[at], blocks[:, layer].movedim(0, axis))


class LayerSave:
    """A save fed layer by layer: :meth:`layer_done` after each layer has written its pages.

    Layer ``i`` of the pages is copied to host staging on the save stream once the compute that
    wrote it is done; after the last layer, the blocks are stored on the core's job thread
    (:attr:`job`, for :meth:`KVConnectorCore.wait`/:meth:`poll`). The engine may write the pages
    again once its compute has waited for :attr:`read` (see :meth:`KVConnectorCore.release_pages`).

    Attributes:
        job: the store's job id once every layer was fed, else None.
        read: the event after the last layer's copy (None until then).
    """

    def __init__(self, keys: list[bytes], caches: Sequence[torch.Tensor], index: torch.Tensor, layout: PageLayout,
                 streams: Streams, staging: Staging, store: Callable[[torch.Tensor, Event, Callable[[], None]], int],
                 on_read: Callable[[Event], None]) -> None:
        self.keys = keys
        self._caches = list(caches)
        self._index = index
        self._axis = layout.page_axis
        self._streams = streams
        self._staging = staging
        self._store = store
        self._on_read = on_read
        first = caches[0]
        page = list(first.shape)
        del page[layout.page_axis]
        n = index.numel()
        self._buf = staging.take(len(caches) * n * math.prod(page) * first.element_size())
        self._stage = typed(self._buf, first.dtype, (len(caches), n, *page))  # layer-major: one copy per layer
        self._fed = [False] * len(caches)
        self._lock = threading.Lock()
        self.job: int | None = None
        self.read: Event | None = None

    @property
    def layers_fed(self) -> int:
        """Layers fed so far."""
        return sum(self._fed)

    def layer_done(self, layer: int, event: Event | None = None) -> int | None:
        """Layer ``layer`` of the pages is written by the compute queued so far (or up to ``event``).

        Feeding a layer again does nothing. Returns the store's job id once every layer was fed.
        """
        with self._lock:
            if self._fed[layer]:
                return self.job
            self._fed[layer] = True
            last = all(self._fed)
        streams = self._streams
        streams.save.wait_event(event if event is not None else streams.compute.record_event())
        cache, dst, index, axis = self._caches[layer], self._stage[layer], self._index, self._axis
        streams.save.run(lambda: dst.copy_(cache.index_select(axis, index).movedim(axis, 0), non_blocking=True))
        if last:
            self.read = streams.save.record_event()
            self._on_read(self.read)
            self.job = self._store(self._stage.movedim(0, 1), self.read, self._done)
        return self.job

    def abandon(self) -> None:
        """Drop a save that will not be fed every layer (its staging is given back)."""
        with self._lock:
            if self.job is None and not all(self._fed):
                self._fed = [True] * len(self._fed)
                self._staging.give_back(self._buf, self._streams.save.record_event())

    def _done(self) -> None:
        self._staging.give_back(self._buf)
