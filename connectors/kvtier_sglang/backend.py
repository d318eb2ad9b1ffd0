"""The HiCache storage backend's behaviour, without SGLang: :class:`PageBackend`.

:class:`kvtier_sglang.storage.KVTierStorage` is this class plus SGLang's ``HiCacheStorage`` base
(so the harness tests drive exactly the methods SGLang calls, where SGLang is not installed).
SGLang's cache controller calls, per request (engine-interfaces.md §5.3)::

    prefetch thread   batch_exists(keys[i:i+128], extra_info) -> int   consecutive hits; TP ranks take the min
                      batch_get_v1(keys, host_indices, extra_info)     load the hit prefix into host pages
    backup thread     batch_set_v1(keys, host_indices, extra_info)     write host pages through

and, without ``interface_v1``, the legacy ``batch_get`` / ``batch_set`` of flat page tensors.

A daemon that is down, silent or restarting never fails SGLang: lookups answer 0, loads load
nothing (the pages are recomputed), saves report failure (SGLang stops that backup); an outage is
logged once. Reads and writes use separate connections, since SGLang's prefetch and backup
threads call concurrently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier_protocol.errors import InvalidRequest, KVTierError
from kvtier_protocol.keys import from_hex
from kvtier_protocol.namespace import Namespace

from kvtier.client import Client, ClientOptions
from kvtier.connector import default_address
from kvtier.connector.blocks import decode_record, encode_records, raw_payload
from kvtier.connector.outage import OutageLog
from kvtier.connector.transfer import MAX_BATCH_BYTES
from kvtier_sglang.pages import PoolBytes, PoolGeometry, read_regions, write_regions
from kvtier_sglang.settings import BackendSettings, build_namespace, resolve_revision

log = logging.getLogger("kvtier.sglang")


class PageBackend:
    """SGLang HiCache L3 pages in a kvtier daemon.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (tp/pp ranks, ``is_mla_model``,
            ``model_name``, ``extra_config``).
        kwargs: what SGLang's factory passes to a dynamic backend (unused).

    Raises:
        InvalidRequest: malformed options in the extra config.
        NamespaceError: no weights revision can be found, or an unsupported sharding.
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(getattr(storage_config, "extra_config", None))
        self.revision = resolve_revision(self.settings, getattr(storage_config, "model_name", None))
        self.is_writer = bool(getattr(storage_config, "is_storage_writer", True))
        options = ClientOptions(token=self.settings.token, timeout_s=self.settings.timeout_s,
                                connect_timeout_s=min(self.settings.timeout_s, 2.0), client_name="kvtier.sglang")
        address = self.settings.address or default_address()
        self._reader = Client(address, options)  # prefetch thread: exists, get
        self._writer = Client(address, options)  # backup thread: set
        self.ns: Namespace | None = None
        self.geometry: PoolGeometry | None = None
        self._pool_bytes: PoolBytes | None = None
        # SGLang recomputes what L3 misses; an outage is logged once, not once per page
        self._outage = OutageLog(log, "SGLang recomputes")

    # -- registration ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host pool whose pages are stored; fixes the namespace (geometry, dtype, shard).

        Raises:
            LayoutError: a pool layout, dtype or geometry kvtier does not store.
            NamespaceError: an unsupported sharding.
        """
        geometry = PoolGeometry.of(mem_pool_host, is_mla=bool(self.storage_config.is_mla_model))
        self.ns = build_namespace(self.settings, self.storage_config, geometry, self.revision)
        self.geometry = geometry
        self._pool_bytes = PoolBytes(mem_pool_host, geometry)
        self.mem_pool_host = mem_pool_host
        log.info("kvtier HiCache backend: %s pages of %d tokens, %s layout, namespace %s",
                 geometry.attention, geometry.page_tokens, geometry.pool_layout, self.ns.ns_id.hex())

    # -- interface_v1 (zero copy into the host pool) --------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the daemon holds (0 when it is down or slow)."""
        if not keys:
            return 0
        ns = self._ns()
        try:
            hits = self._reader.lookup(ns.ns_id, _hashes(keys), degrade=False,
                                       accept_lossy=self.settings.accept_lossy).num_hits
        except KVTierError as exc:
            self._outage.failed("lookup", exc)
            return 0
        self._outage.ok()
        return hits

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load pages ``keys`` into the host pages at ``host_indices`` (``page_size`` per key).

        Returns:
            Per key, whether its page was loaded: a run of True, then False from the first miss.
        """
        geometry, pool = self._pool()
        regions = pool.regions(host_indices, len(keys))
        done = self._load(keys, geometry.region_layout, lambda i, payload: write_regions(regions[i], payload))
        return [i < done for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host pages at ``host_indices`` under ``keys``; pages already stored succeed.

        ``extra_info.prefix_keys`` (the page hashes before ``keys``) names the first page's parent.
        On an MLA rank that is not the storage writer nothing is written (the writer stores the
        same pages) and every key succeeds.
        """
        geometry, pool = self._pool()
        regions = pool.regions(host_indices, len(keys))
        if not self.is_writer:
            return [True] * len(keys)

        def page(i: int) -> torch.Tensor:
            raw = torch.from_numpy(read_regions(regions[i]))
            return raw.view(geometry.dtype).reshape(geometry.shape(geometry.region_layout))
        return self._store(keys, page, geometry.region_layout, _parent(extra_info))

    # -- legacy interface (flat page tensors) -----------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One page as a flat tensor in the pool's layout (written into ``target_location`` when
        given); None on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Pages as flat tensors (into ``target_locations`` when given): the stored prefix, then None."""
        geometry, _ = self._pool()
        if target_locations is not None and len(target_locations) != len(keys):
            raise InvalidRequest(f"{len(target_locations)} target locations for {len(keys)} keys")
        out: list[torch.Tensor | None] = [None] * len(keys)
        page_elems = geometry.page_bytes // geometry.dtype.itemsize

        def put(i: int, payload: memoryview | np.ndarray) -> None:
            target = None if target_locations is None else target_locations[i]
            if target is None:
                target = torch.empty(page_elems, dtype=geometry.dtype)
            _flat_bytes(target, geometry.page_bytes)[:] = np.frombuffer(payload, dtype=np.uint8)
            out[i] = target
        self._load(keys, geometry.flat_layout, put)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page (``host_pool.get_data_page(index, flat=True)``) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages under ``keys`` (a chain, first first); True when every page is stored."""
        geometry, _ = self._pool()
        if values is None or len(values) != len(keys):
            raise InvalidRequest(f"batch_set needs one page per key, got {None if values is None else len(values)}")
        if not self.is_writer:
            return True
        shape = geometry.shape(geometry.flat_layout)

        def page(i: int) -> torch.Tensor:
            value = values[i]
            if not isinstance(value, torch.Tensor) or value.numel() * value.element_size() != geometry.page_bytes:
                raise InvalidRequest(f"page {i} is not a flat tensor of {geometry.page_bytes} bytes")
            return value.detach().reshape(-1).view(geometry.dtype).reshape(shape)
        return all(self._store(keys, page, geometry.flat_layout, None))

    def exists(self, key: str) -> bool:
        """Whether the daemon holds page ``key``."""
        return self.batch_exists([key]) == 1

    # -- housekeeping -------------------------------------------------------------------------------

    def clear(self) -> bool:
        """Drop every page of this namespace from the daemon (SGLang's cache flush)."""
        try:
            self._writer.clear(self._ns().ns_id)
        except KVTierError as exc:
            self._outage.failed("clear", exc)
            return False
        return True

    def close(self) -> None:
        """Close the daemon connections."""
        self._reader.close()
        self._writer.close()

    # -- internals ---------------------------------------------------------------------------------

    def _ns(self) -> Namespace:
        if self.ns is None:
            raise InvalidRequest("register_mem_pool_host() first: the backend knows no host pool")
        return self.ns

    def _pool(self) -> tuple[PoolGeometry, PoolBytes]:
        self._ns()
        assert self.geometry is not None and self._pool_bytes is not None, "set with ns"
        return self.geometry, self._pool_bytes

    def _batch(self) -> int:
        assert self.geometry is not None, "a pool is bound"
        return max(1, MAX_BATCH_BYTES // self.geometry.page_bytes)

    def _load(self, keys: Sequence[str], layout: str, put: Any) -> int:
        """Load the stored prefix of ``keys`` as page bytes in ``layout``; ``put(i, bytes)`` each.

        Returns:
            Pages put, from the first; fewer at a miss, a bad block or a daemon failure.
        """
        ns, geometry = self._ns(), self.geometry
        assert geometry is not None, "set with ns"
        hashes, shape, done = _hashes(keys), geometry.shape(layout), 0
        for lo in range(0, len(hashes), self._batch()):
            chunk = hashes[lo:lo + self._batch()]
            try:
                records = self._reader.load(ns.ns_id, chunk, degrade=False, accept_lossy=self.settings.accept_lossy)
            except KVTierError as exc:
                self._outage.failed("load", exc)
                return done
            self._outage.ok()
            for record in records:
                payload = raw_payload(record, layout=layout, shape=shape, dtype=ns.kv_dtype)
                if payload is None:  # another layout or codec: decode and convert
                    block, why = decode_record(record, layout=layout, shape=shape, dtype=geometry.dtype, device="cpu")
                    if block is None:
                        log.warning("kvtier page %s %s; recomputing from there", keys[done], why)
                        return done
                    payload = block.reshape(-1).view(torch.uint8).numpy()
                put(done, payload)
                done += 1
            if len(records) < len(chunk):
                break
        return done

    def _store(self, keys: Sequence[str], page: Any, layout: str, parent: bytes | None) -> list[bool]:
        """Store ``page(i)`` (a tensor in ``layout``) under each key not stored yet; per key, success."""
        if not keys:
            return []
        ns, hashes = self._ns(), _hashes(keys)
        try:  # skip the stored prefix before copying anything out of the pool
            first = self._writer.lookup(ns.ns_id, hashes, degrade=False).num_hits
        except KVTierError as exc:
            self._outage.failed("save", exc)
            return [False] * len(keys)
        ok = [True] * first + [False] * (len(keys) - first)
        fields = ns.to_wire()
        for lo in range(first, len(hashes), self._batch()):
            hi = min(len(hashes), lo + self._batch())
            pages = [page(i) for i in range(lo, hi)]  # a malformed page raises: a caller's bug
            try:
                records = encode_records(ns, hashes[lo:hi], pages, layout=layout,
                                         parent=parent if lo == 0 else hashes[lo - 1], ns_fields=fields)
                statuses = self._writer.save(ns.ns_id, records, priority=self.settings.priority)
            except KVTierError as exc:  # daemon down or full, or a codec refusing the data (NaN)
                self._outage.failed("save", exc)
                return ok
            self._outage.ok()
            for i, status in enumerate(statuses):
                ok[lo + i] = status in ("stored", "exists")
            if "full" in statuses:
                break
        return ok


def _hashes(keys: Sequence[str]) -> list[bytes]:
    """SGLang's hex page hashes as chain hashes (InvalidKey for anything else)."""
    return [from_hex(k) for k in keys]


def _parent(extra_info: Any) -> bytes | None:
    """The page hash before a call's keys: the last of ``extra_info.prefix_keys``, if any."""
    prefix = getattr(extra_info, "prefix_keys", None)
    return from_hex(prefix[-1]) if prefix else None


def _flat_bytes(target: Any, nbytes: int) -> np.ndarray:
    """A writable byte view of a contiguous CPU tensor of exactly ``nbytes`` bytes."""
    if (not isinstance(target, torch.Tensor) or target.device.type != "cpu" or not target.is_contiguous()
            or target.numel() * target.element_size() != nbytes):
        raise InvalidRequest(f"a target location must be a contiguous CPU tensor of {nbytes} bytes")
    return target.detach().reshape(-1).view(torch.uint8).numpy()
