"""The engine-agnostic connector core: lookup, load and save of prefix blocks between an engine's
paged KV cache and the kvtier daemon (docs/design.md §4).

::

    engine                     KVConnectorCore                            kvtierd
    block_hashes(tokens) ───►  ns.block_keys
    lookup(hashes)       ───►  one lookup ────────────────────────────►  leading hits
    load(hashes, pages)  ───►  load (shm) → decode_block(layout) → scatter into pages
    save(hashes, pages)  ───►  lookup (skip stored) → gather pages → encode_block → save (shm)
    start_load(...)      ───►  the same load, its pages placed layer by layer (LayerLoad.wait_layer)
    start_save(...)      ───►  the same save, fed layer by layer (LayerSave.layer_done)

Layer-wise transfers (:mod:`kvtier.connector.layerwise`) overlap the copies with the engine's
compute; their copies run on the streams of :mod:`kvtier.connector.streams` (dedicated CUDA
streams ordered by events on a GPU, synchronous on a host).

A daemon that is down, silent or restarting never fails the engine: within ``timeout_s`` lookup
answers 0, load stops (the engine recomputes the rest) and save stores nothing; the client
reconnects on a later call. Wrong KV is never written: records are verified by the client and
every decoded block must have the namespace's geometry and dtype.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvtier_protocol.errors import InvalidRequest
from kvtier_protocol.keys import ExtraKeys
from kvtier_protocol.namespace import Namespace
from kvtier_protocol.wire_checks import PRIORITY_MAX, PRIORITY_MIN

from kvtier.client import Client, ClientOptions
from kvtier.client.records import check_hashes
from kvtier_protocol.address import default_address
from kvtier.connector.blocks import expected_shape, kv_dtype, token_info
from kvtier.connector.jobs import JobResult, JobRunner
from kvtier.connector.layerwise import LayerLoad, LayerSave, run_load
from kvtier.connector.pages import check_caches, gather_blocks, get_page_layout, host_views, page_index
from kvtier.connector.stats import ConnectorStats
from kvtier.connector.streams import Event, HostStream, Staging, Streams, streams_for
from kvtier.connector.transfer import Outcome, Transfer


def check_priority(priority: int) -> None:
    """Raise InvalidRequest unless ``priority`` is an eviction priority (-128..127)."""
    if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidRequest(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority!r}")



class KVConnectorCore:
    """Prefix blocks of one namespace between an engine's paged KV caches and the daemon.

    Args:
        ns: the namespace of the engine's KV (see :func:`namespace_for_checkpoint`).
        address: the daemon (``"unix:/path"`` for the shared-memory path, ``"tcp://host:port"``);
            None: :func:`default_address`. Ignored when ``client`` is given.
        client: a client to use, also by background jobs (not closed by :meth:`close`); None: the
            core makes two, one for the engine's calls and one for its jobs.
        codec: how blocks are stored (``"raw"``, ``"int8"``, ``"int4"``, ...); None keeps the
            namespace's ``kv_codec``. Another codec is another namespace (:attr:`ns` is updated).
        page_layout: the engine's page layout, a key of :data:`kvtier.connector.pages.PAGE_LAYOUTS`.
        timeout_s: bound on each daemon call, reconnects and retries included.
        token: the daemon's token (TCP).
        streams: the streams of layer-wise copies; None: chosen from the bound caches' device
            (:func:`kvtier.connector.streams.streams_for`).
        accept_lossy: False: exact copies only (a block the daemon holds lossily, e.g. re-encoded
            int8 by a lossy disk tier, is a miss, and the engine recomputes it); None: the
            daemon's default (``store.accept_lossy``, true unless configured).

    Raises:
        LayoutError: the page layout does not fit the namespace.
        InvalidRequest: a malformed address or option. Never because the daemon is down.
    """

    def __init__(self, ns: Namespace, *, address: str | None = None, client: Client | None = None,
                 codec: str | None = None, page_layout: str = "vllm-flash", timeout_s: float = 2.0,
                 token: str | None = None, streams: Streams | None = None, accept_lossy: bool | None = None) -> None:
        if codec is not None and codec != ns.kv_codec:
            ns = dataclasses.replace(ns, kv_codec=codec)
        self.ns = ns
        self.page_layout = get_page_layout(page_layout)
        self.block_shape = self.page_layout.block_shape(ns)  # raises LayoutError on a misfit
        self.timeout_s = timeout_s
        self.stats = ConnectorStats()
        self._owns_client = client is None
        if client is None:
            options = ClientOptions(token=token, timeout_s=timeout_s, connect_timeout_s=min(timeout_s, 2.0),
                                    client_name="kvtier.connector")
            client = Client(address or default_address(), options)
            # Jobs get a connection of their own, so that a lookup of the engine's next request
            # never queues behind a background save (a client runs one call at a time).
            self._job_client = Client(client.address, options)
        else:
            self._job_client = client
        self.client = client
        self.accept_lossy = accept_lossy
        self._transfer = Transfer(ns, client, self.stats, accept_lossy)
        self._job_transfer = Transfer(ns, self._job_client, self.stats, accept_lossy)
        self._caches: list[torch.Tensor] | None = None
        self._views: list[np.ndarray] | None = None  # byte views of CPU caches, for raw records
        self._num_pages = 0
        self._jobs = JobRunner(1)
        # Layer-wise loads are on the engine's critical path: a thread of their own (never queued
        # behind a background save) and the engine's client (whose calls are serialized).
        self._load_jobs = JobRunner(1, name="kvtier-layer-load")
        self._given_streams = streams
        self.streams: Streams = streams if streams is not None else streams_for("cpu")
        self._staging = Staging(pinned=self.streams.on_cuda)
        self._reads: list[Event] = []  # saves' "pages read" events the compute has not waited for
        self._reads_lock = threading.Lock()

    # -- engine side ---------------------------------------------------------------------------

    def bind_kv_caches(self, caches: Sequence[torch.Tensor]) -> None:
        """Use these per-layer caches (``page_layout``'s shape, the namespace's dtype) from now on.

        Raises:
            LayoutError: wrong layer count, shape, dtype or mixed devices.
        """
        caches = list(caches)
        self._num_pages = check_caches(caches, self.page_layout, self.ns)
        if self._given_streams is None and (self._caches is None or self._caches[0].device != caches[0].device):
            self.streams = streams_for(caches[0].device)
            self._staging = Staging(pinned=self.streams.on_cuda)
        self._caches = caches
        self._views = host_views(caches)

    def block_hashes(self, token_ids: Sequence[int], extras: ExtraKeys | None = None) -> list[bytes]:
        """Chain hashes of the full blocks of ``token_ids`` (from position 0) in this namespace."""
        return self.ns.block_keys(token_ids, extras)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, the daemon holds; 0 when it is down or slow."""
        return self._transfer.lookup(check_hashes(hashes))

    def load(self, hashes: Sequence[bytes], page_ids: Sequence[int]) -> int:
        """Load blocks ``hashes`` into pages ``page_ids`` (pairwise), in order from the first.

        Returns:
            Blocks written, consecutive from the first: fewer than asked at the first miss, bad
            block or daemon failure; the engine recomputes the rest.

        Raises:
            InvalidRequest: no caches bound, lengths differ, a page id out of range or repeated.
        """
        keys, index = check_hashes(hashes), self._index(hashes, page_ids)
        return self._transfer.load(keys, self._bound(), self._views, index, self.page_layout, self.block_shape)[0]

    def save(self, hashes: Sequence[bytes], page_ids: Sequence[int], *, token_ids: Sequence[int] | None = None,
             parent: bytes | None = None, priority: int = 0) -> int:
        """Store the full blocks in pages ``page_ids`` under ``hashes``; blocks already stored are skipped.

        Args:
            hashes: chain hashes of consecutive blocks, from the request's first block (or the
                block after ``parent``).
            page_ids: the page holding each block.
            token_ids: optionally, the tokens from the first block on (for the daemon's KV events).
            parent: chain hash of the block before ``hashes[0]``; None: ``hashes`` start the chain.
            priority: eviction priority, -128..127 (higher is kept longer; e.g. system prompts).

        Returns:
            Blocks newly stored (0 when the daemon is down, slow or full).

        Raises:
            InvalidRequest: no caches bound, lengths differ, bad page ids, too few token ids.
        """
        keys, index, caches = check_hashes(hashes), self._index(hashes, page_ids), self._bound()
        check_priority(priority)
        return self._transfer.put(keys, lambda lo, hi: gather_blocks(caches, index[lo:hi], self.page_layout),
                                  self.page_layout.block_layout, token_ids, parent, priority)[0]

    # -- layer-wise ----------------------------------------------------------------------------------

    def start_load(self, hashes: Sequence[bytes], page_ids: Sequence[int]) -> LayerLoad:
        """:meth:`load`, consumed layer by layer: the records are fetched and verified on the
        connector's load thread, then placed one layer at a time (see :class:`LayerLoad`). With
        synchronous host streams the records are fetched in the caller's thread before this returns.

        Call from the engine's thread (the load is ordered after the compute queued so far). The
        engine must not read the pages of layer ``i`` before :meth:`LayerLoad.wait_layer` (``i``).

        Raises:
            InvalidRequest: no caches bound, lengths differ, a page id out of range or repeated.
        """
        keys, index = check_hashes(hashes), self._index(hashes, page_ids)
        caches, views = self._bound(), self._views
        load = LayerLoad(len(caches), len(keys))
        with self._reads_lock:
            after = [self.streams.compute.record_event(), *self._reads]
        streams, staging = self.streams, self._staging
        if isinstance(streams.load, HostStream):
            # Synchronous host copies: no thread to hand over to (on a busy host a wake-up costs more
            # than it could overlap); the records are fetched here and each layer is placed by
            # wait_layer as the engine reaches it.
            run_load(load, self._transfer, keys, caches, views, index, self.page_layout, self.block_shape, streams,
                     staging, after)
            return load
        self._load_jobs.submit(lambda job: run_load(load, self._transfer, keys, caches, views, index, self.page_layout,
                                                    self.block_shape, streams, staging, after) or JobResult(job, True, 0))
        return load

    def start_save(self, hashes: Sequence[bytes], page_ids: Sequence[int], *,
                   token_ids: Sequence[int] | None = None, parent: bytes | None = None,
                   priority: int = 0) -> LayerSave:
        """:meth:`submit_save`, fed layer by layer: call :meth:`LayerSave.layer_done` (``i``) once
        layer ``i`` of the pages is written (queued on the compute stream); after the last layer
        the blocks are stored on the job thread (:attr:`LayerSave.job`).

        The engine must not write the pages again before :meth:`release_pages`.

        Raises:
            InvalidRequest: no caches bound, lengths differ, bad page ids, too few token ids, a
                bad priority.
        """
        keys, index, caches = check_hashes(hashes), self._index(hashes, page_ids), self._bound()
        check_priority(priority)
        token_info(self.ns, keys, token_ids, parent)  # raise too-few-tokens now, not in the worker
        tokens = None if token_ids is None else list(token_ids)
        layout = self.page_layout.block_layout

        def store(blocks: torch.Tensor, read: Event, done: Callable[[], None]) -> int:
            def work(job: int) -> JobResult:
                try:
                    read.synchronize()  # every layer's copy to staging has ended
                    stored, error = self._job_transfer.put(keys, lambda lo, hi: blocks[lo:hi], layout, tokens,
                                                           parent, priority)
                finally:
                    done()
                return JobResult(job, error is None, stored, error)
            return self._jobs.submit(work)

        def on_read(event: Event) -> None:
            with self._reads_lock:
                self._reads.append(event)

        return LayerSave(keys, caches, index, self.page_layout, self.streams, self._staging, store, on_read)

    def release_pages(self) -> None:
        """Order the engine's compute after every layer-wise save's reads of its pages: call before
        the engine writes pages again (a GPU-side wait on CUDA; nothing to wait for on a host)."""
        with self._reads_lock:
            reads, self._reads = self._reads, []
        for event in reads:
            self.streams.compute.wait_event(event)

    # -- tensors (engines without pages, e.g. HF transformers) ---------------------------------

    def fetch(self, hashes: Sequence[bytes], *, layout: str | None = None, device: Any = "cpu") -> list[torch.Tensor]:
        """Block tensors of the stored prefix of ``hashes`` in ``layout`` on ``device`` (shorter on a
        miss, bad block or daemon failure; empty when the daemon is down).

        Args:
            layout: a kvtier layout; None: the canonical one (``canonical`` ``[L, 2, H, T, D]``,
                or ``mla-latent`` ``[L, T, C]`` for MLA).

        Raises:
            LayoutError: an unknown layout, or one of the other attention kind.
        """
        layout = layout or ("mla-latent" if self.ns.attention == "mla" else "canonical")
        expected_shape(self.ns, layout)  # LayoutError for an unknown layout or one of the other attention kind
        return self._transfer.fetch(check_hashes(hashes), layout, device)

    def fetch_into(self, hashes: Sequence[bytes], out: torch.Tensor, *, layout: str | None = None) -> int:
        """The stored prefix of ``hashes`` written into ``out[i]``, block ``i`` in ``layout``.

        The copy-once form of :meth:`fetch`: raw blocks go straight from the daemon's shared
        memory into ``out``, so a load costs one copy at memory bandwidth.

        Args:
            out: a contiguous CPU tensor ``[len(hashes), *block shape]`` of the namespace's dtype.
            layout: as in :meth:`fetch`.

        Returns:
            Blocks written, consecutive from the first (fewer on a miss, bad block or failure).

        Raises:
            LayoutError: an unknown layout, or one of the other attention kind.
            InvalidRequest: ``out`` is not such a tensor.
        """
        layout = layout or ("mla-latent" if self.ns.attention == "mla" else "canonical")
        shape = expected_shape(self.ns, layout)
        want = (len(hashes), *shape)
        if (tuple(out.shape) != want or out.dtype != kv_dtype(self.ns) or out.device.type != "cpu"
                or not out.is_contiguous()):
            raise InvalidRequest(f"fetch_into needs a contiguous CPU {kv_dtype(self.ns)} tensor {want}, got "
                                 f"{out.dtype} {tuple(out.shape)} on {out.device}")
        return self._transfer.fetch_into(check_hashes(hashes), out, layout, shape)

    def store(self, hashes: Sequence[bytes], tensors: Sequence[torch.Tensor], *, layout: str,
              token_ids: Sequence[int] | None = None, parent: bytes | None = None, priority: int = 0) -> int:
        """Store block tensors (in ``layout``, any device) under ``hashes``, as :meth:`save` does pages.

        Raises:
            InvalidRequest: the lengths differ, too few token ids.
            LayoutError: a layout of the other attention kind.
        """
        if len(tensors) != len(hashes):
            raise InvalidRequest(f"{len(tensors)} tensors for {len(hashes)} hashes")
        expected_shape(self.ns, layout)
        check_priority(priority)
        return self._transfer.put(check_hashes(hashes), lambda lo, hi: tensors[lo:hi], layout, token_ids, parent,
                                  priority)[0]

    # -- asynchronous variants -------------------------------------------------------------------

    def submit_load(self, hashes: Sequence[bytes], page_ids: Sequence[int]) -> int:
        """:meth:`load` on the connector's worker thread; returns a job id for :meth:`poll`/:meth:`wait`.

        The engine must not read or reuse the pages until the job is reported.
        """
        keys, index = check_hashes(hashes), self._index(hashes, page_ids)
        caches, views = self._bound(), self._views  # the pages bound now, even if the engine rebinds
        return self._jobs.submit(lambda job: self._result(job, len(keys), self._job_transfer.load(
            keys, caches, views, index, self.page_layout, self.block_shape)))

    def submit_save(self, hashes: Sequence[bytes], page_ids: Sequence[int], *,
                    token_ids: Sequence[int] | None = None, parent: bytes | None = None, priority: int = 0) -> int:
        """:meth:`save` on the worker thread; the pages are copied now (on their device), so the
        engine may reuse them as soon as this returns."""
        keys, index = check_hashes(hashes), self._index(hashes, page_ids)
        check_priority(priority)
        snapshot = gather_blocks(self._bound(), index, self.page_layout)
        token_info(self.ns, keys, token_ids, parent)  # raise too-few-tokens now, not in the worker
        tokens = None if token_ids is None else list(token_ids)

        def work(job: int) -> JobResult:
            outcome = self._job_transfer.put(keys, lambda lo, hi: snapshot[lo:hi], self.page_layout.block_layout,
                                             tokens, parent, priority)
            return JobResult(job, outcome[1] is None, outcome[0], outcome[1])
        return self._jobs.submit(work)

    def poll(self) -> list[JobResult]:
        """Jobs finished since the last poll (each reported once); never blocks."""
        return self._jobs.poll()

    def wait(self, job: int, timeout_s: float | None = None) -> JobResult:
        """Block until ``job`` finishes; see :meth:`JobRunner.wait`."""
        return self._jobs.wait(job, timeout_s)

    def close(self) -> None:
        """Finish the running job, drop queued ones, and close the client if this core made it."""
        self._load_jobs.close(wait=True)
        self._jobs.close(wait=True)
        if self._owns_client:
            self.client.close()
            self._job_client.close()

    def __enter__(self) -> KVConnectorCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------

    def _bound(self) -> list[torch.Tensor]:
        if self._caches is None:
            raise InvalidRequest("bind_kv_caches() first: the connector has no KV caches")
        return self._caches

    def _index(self, hashes: Sequence[bytes], page_ids: Sequence[int]) -> torch.Tensor:
        caches = self._bound()
        if len(hashes) != len(page_ids):
            raise InvalidRequest(f"{len(hashes)} hashes for {len(page_ids)} page ids")
        return page_index(page_ids, self._num_pages, caches[0].device)

    @staticmethod
    def _result(job: int, wanted: int, outcome: Outcome) -> JobResult:
        count, error = outcome
        return JobResult(job, error is None and count == wanted, count, error)
