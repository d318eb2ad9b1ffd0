"""Block transfers of the connector core: every daemon call it makes, and how each failure degrades.

A :class:`Transfer` turns the client's errors into outcomes: ``(blocks done, why it fell short)``.
An unavailable daemon (down, silent, restarting, refusing) is logged once per outage, not once
per request; a bad record stops a load at that block, so an engine recomputes from there and
never reads wrong KV.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvtier_protocol.errors import InvalidRequest, KVTierError
from kvtier_protocol.layouts import convert_many
from kvtier_protocol.namespace import Namespace

from kvtier.client import Client
from kvtier.connector.blocks import decode_stacked, encode_records, kv_dtype, raw_payload, token_info
from kvtier.connector.outage import OutageLog
from kvtier.connector.pages import PageLayout, scatter_blocks, write_page_bytes
from kvtier.connector.stats import ConnectorStats

log = logging.getLogger("kvtier.connector")

MAX_BATCH_BYTES = 256 << 20
"""Raw KV bytes moved per client call: bounds the records held in memory at once."""

Outcome = tuple[int, str | None]
"""``(blocks loaded or newly stored, why the call fell short or None)``."""

BlocksOf = Callable[[int, int], Any]
"""``blocks_of(lo, hi)``: block tensors ``lo..hi-1`` of a save (a stacked tensor or a sequence)."""


class Transfer:
    """Lookups, loads and saves of one namespace through one client.

    Args:
        ns: the namespace (its codec encodes saved blocks).
        client: the daemon client; its ``timeout_s`` bounds every call.
        stats: counters to add to.
        accept_lossy: False: lookups and loads count and read exact copies only (a block the daemon
            holds re-encoded lossily, e.g. int8 on a lossy disk tier, is a miss); None: the daemon's
            default (``store.accept_lossy``).
    """

    def __init__(self, ns: Namespace, client: Client, stats: ConnectorStats, accept_lossy: bool | None = None) -> None:
        self.ns = ns
        self.client = client
        self.stats = stats
        self.accept_lossy = accept_lossy
        self.batch_blocks = max(1, MAX_BATCH_BYTES // ns.block_payload_bytes())
        self._ns_fields = ns.to_wire()
        self._outage = OutageLog(log, "recomputing", prefix="kvtier connector")

    def lookup(self, hashes: list[bytes]) -> int:
        """Leading stored blocks of ``hashes``; 0 when the daemon fails."""
        if not hashes:
            return 0
        try:
            hits = self.client.lookup(self.ns.ns_id, hashes, degrade=False, accept_lossy=self.accept_lossy).num_hits
        except KVTierError as exc:
            self._failed("lookup", exc)
            return 0
        self._outage.ok()
        self.stats.add(lookups=1, lookup_hits=hits)
        return hits

    def load(self, hashes: list[bytes], caches: Sequence[torch.Tensor], views: list[np.ndarray] | None,
             index: torch.Tensor, layout: PageLayout, shape: tuple[int, ...]) -> Outcome:
        """Load ``hashes`` into the pages of ``index``, in order, stopping at the first miss or bad block.

        Raw records of the pages' own layout go straight from the record into CPU pages through
        ``views``; the others are decoded (codec, layout) and scattered in one batch per call.
        """
        dtype = kv_dtype(self.ns)
        # Raw blocks are host bytes anyway: decode on the host, then one transfer per batch.
        device = "cpu" if self.ns.kv_codec == "raw" else caches[0].device
        pages = index.tolist()
        loaded, error = 0, None
        for lo in range(0, len(hashes), self.batch_blocks):
            chunk = hashes[lo:lo + self.batch_blocks]
            records, error = self._records(chunk)
            if error is None and len(records) < len(chunk):
                error = f"miss at block {lo + len(records)} of {len(hashes)}"
            raw: list[tuple[int, memoryview]] = []
            todo: list[tuple[int, bytes]] = []
            for i, record in enumerate(records):
                payload = None if views is None else raw_payload(
                    record, layout=layout.block_layout, shape=shape, dtype=self.ns.kv_dtype)
                if payload is not None:
                    raw.append((lo + i, payload))
                else:
                    todo.append((lo + i, record))
            groups, bad, why = decode_stacked(self.ns, todo, dtype, device)
            if bad is not None:  # nothing from the first bad block on reaches the pages
                error = _bad_block(bad, why)
                records = records[:bad - lo]
            for at, payload in raw:
                if bad is None or at < bad:
                    write_page_bytes(views, pages[at], payload, layout)
            for src, (at, blocks) in groups.items():
                scatter_blocks(caches, index[at], convert_many(blocks, src, layout.block_layout, contiguous=False),
                               layout)
            loaded += len(records)
            if error is not None:
                break
        self.stats.add(loaded_blocks=loaded)
        return loaded, error

    def fetch(self, hashes: list[bytes], layout: str, device: Any) -> list[torch.Tensor]:
        """Decoded blocks of the stored prefix of ``hashes`` in ``layout``, up to the first miss or bad block."""
        out: list[torch.Tensor] = []
        for groups, count in self._decoded(hashes, layout, device, contiguous=True):
            got: list[torch.Tensor | None] = [None] * count
            for at, blocks in groups:
                for i, block in zip(at, blocks.unbind(0)):
                    got[i - len(out)] = block
            out.extend(got)  # type: ignore[arg-type]  # every position of the batch's prefix is filled
        self.stats.add(loaded_blocks=len(out))
        return out

    def fetch_into(self, hashes: list[bytes], out: torch.Tensor, layout: str, shape: tuple[int, ...]) -> int:
        """The stored prefix of ``hashes`` into ``out[i]`` (a contiguous CPU tensor ``[n, *shape]``
        of the namespace's dtype), in ``layout``; returns the blocks written, from the first.

        Raw blocks of ``layout`` go straight from the daemon's shared memory into ``out``: one copy,
        no record allocated, no hashing of payloads the daemon checked. A block stored otherwise
        (another engine's layout) and every block after it are fetched and decoded instead.
        """
        assert out.is_contiguous() and out.device.type == "cpu" and tuple(out.shape[1:]) == shape, "see docstring"
        rows = out.view(torch.uint8).view(len(hashes), -1)  # bytes per block (a bf16 tensor has no numpy view)
        dtype, done, foreign = self.ns.kv_dtype, 0, False
        for lo in range(0, len(hashes), self.batch_blocks):
            hi = min(len(hashes), lo + self.batch_blocks)
            try:
                headers = self.client.load_into(self.ns.ns_id, hashes[lo:hi], [rows[i].numpy() for i in range(lo, hi)],
                                                degrade=False, accept_lossy=self.accept_lossy)
            except InvalidRequest:  # a block larger than a row: not of this geometry, decode from here
                foreign = True
                break
            except KVTierError as exc:
                self._failed("load", exc)
                break
            self._outage.ok()
            for h in headers:
                if h.codec != "raw" or h.compression is not None or h.layout != layout or tuple(h.shape) != shape or h.dtype != dtype:
                    foreign = True
                    break
                done += 1
            if foreign or done < hi:
                break
        if foreign:
            start = done
            for groups, count in self._decoded(hashes[start:], layout, "cpu", contiguous=False):
                for at, blocks in groups:  # one strided copy per stored layout
                    out.index_copy_(0, torch.tensor(at) + start, blocks)
                done += count
        self.stats.add(loaded_blocks=done)
        return done

    def _decoded(self, hashes: list[bytes], layout: str, device: Any, *,
                 contiguous: bool) -> Iterator[tuple[list[tuple[list[int], torch.Tensor]], int]]:
        """Per batch of the stored prefix of ``hashes``: its blocks decoded and converted to
        ``layout``, as ``(positions in hashes, blocks [n, *block])`` per stored layout, and how
        many blocks the batch adds (consecutive). Ends after a miss, a failed call or a bad block."""
        dtype = kv_dtype(self.ns)
        for lo in range(0, len(hashes), self.batch_blocks):
            chunk = hashes[lo:lo + self.batch_blocks]
            records, error = self._records(chunk)
            groups, bad, why = decode_stacked(self.ns, list(enumerate(records, lo)), dtype, device)
            converted = [(at, convert_many(blocks, src, layout, contiguous=contiguous))
                         for src, (at, blocks) in groups.items()]
            yield converted, len(records) if bad is None else bad - lo
            if bad is not None:
                _bad_block(bad, why)
                return
            if error is not None or len(records) < len(chunk):
                return

    def put(self, hashes: list[bytes], blocks_of: BlocksOf, layout: str, token_ids: Sequence[int] | None,
            parent: bytes | None, priority: int) -> Outcome:
        """Store blocks under ``hashes`` (a chain after ``parent``), skipping the stored prefix.

        Raises:
            InvalidRequest: too few ``token_ids`` for the blocks.
        """
        if not hashes:
            return 0, None
        tokens, units = token_info(self.ns, hashes, token_ids, parent)
        try:  # skip the stored prefix before copying anything out of the pages
            first = self.client.lookup(self.ns.ns_id, hashes, degrade=False).num_hits
        except KVTierError as exc:
            return 0, self._failed("save", exc)
        stored, skipped, error = 0, first, None
        for lo in range(first, len(hashes), self.batch_blocks):
            hi = min(len(hashes), lo + self.batch_blocks)
            try:
                blocks = blocks_of(lo, hi)
                if isinstance(blocks, torch.Tensor) and self.ns.kv_codec == "raw":
                    blocks = blocks.cpu()  # one device-to-host copy for the batch
                records = encode_records(self.ns, hashes[lo:hi], blocks, layout=layout,
                                         parent=parent if lo == 0 else hashes[lo - 1], ns_fields=self._ns_fields)
                results = self.client.save(self.ns.ns_id, records, tokens=None if tokens is None else tokens[lo:hi],
                                           unit_hashes=None if units is None else units[lo:hi], priority=priority)
            except KVTierError as exc:
                error = self._failed("save", exc)
                break
            stored += results.count("stored")
            skipped += results.count("exists")
            if "full" in results:
                error = f"daemon full: {results.count('full')} of {hi - lo} blocks not stored"
        else:
            self._outage.ok()
        self.stats.add(saved_blocks=stored, skipped_blocks=skipped)
        return stored, error

    def records(self, hashes: list[bytes]) -> tuple[list[bytes], str | None]:
        """The stored prefix of ``hashes`` as verified records; ``[]`` and why, if the call failed."""
        return self._records(hashes)

    def _records(self, hashes: list[bytes]) -> tuple[list[bytes], str | None]:
        try:
            records = self.client.load(self.ns.ns_id, hashes, degrade=False, accept_lossy=self.accept_lossy)
        except KVTierError as exc:
            return [], self._failed("load", exc)
        self._outage.ok()
        return records, None

    def _failed(self, op: str, exc: KVTierError) -> str:
        """Count a failed daemon call; log it (an outage once, not once per request)."""
        self.stats.add(failed_calls=1)
        return self._outage.failed(op, exc)


def _bad_block(i: int, why: str | None) -> str:
    error = f"block {i} {why}"
    log.warning("kvtier connector: %s; recomputing from there", error)
    return error
