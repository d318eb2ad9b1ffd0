"""SGLang's side of the HiCache storage interface, on CPU, for the harness tests.

SGLang's host pools need its CUDA build to import, so this kit rebuilds what a storage backend
sees of them from SGLang 0.5.23's source (``mem_cache/pool_host/mha.py`` and ``mla.py``):
``kv_buffer`` in each ``--hicache-mem-layout``, ``get_page_buffer_meta``, ``get_data_page``,
``get_dummy_flat_data_page`` and ``set_from_flat_data_page`` with the same arithmetic, and the
cache controller's call order (``managers/cache_controller.py``: ``_storage_hit_query``,
``_page_transfer``, ``_page_backup``, zero-copy and generic page functions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtier_protocol.keys import SGLANG_SCHEME, chain_hashes, to_hex

STORAGE_BATCH_SIZE = 128  # SGLang's pages per storage call


@dataclass
class StorageConfig:
    """SGLang's ``HiCacheStorageConfig`` (the fields a backend reads)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: dict | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None

    @property
    def is_storage_writer(self) -> bool:
        return not self.is_mla_model or self.tp_rank == self.dcp_rank


@dataclass
class ExtraInfo:
    """SGLang's ``HiCacheStorageExtraInfo``."""

    prefix_keys: list[str] | None = None
    extra_info: dict | None = None


class MHAHostPool:
    """``MHATokenToKVPoolHost`` as a storage backend sees it."""

    def __init__(self, layout: str, *, layer_num: int = 3, head_num: int = 2, head_dim: int = 8,
                 page_size: int = 4, page_num: int = 16, dtype: torch.dtype = torch.float32) -> None:
        self.layout, self.layer_num, self.head_num, self.head_dim = layout, layer_num, head_num, head_dim
        self.v_head_dim = head_dim
        self.page_size, self.page_num, self.size, self.dtype = page_size, page_num, page_num * page_size, dtype
        self.device = "cpu"
        self.pin_memory = False
        dims = {"layer_first": (2, layer_num, self.size, head_num, head_dim),
                "page_first": (2, self.size, layer_num, head_num, head_dim),
                "page_first_direct": (2, page_num, layer_num, page_size, head_num, head_dim),
                "page_head": (2, page_num, head_num, page_size, layer_num, head_dim)}[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        else:
            page = self.kv_buffer[:, index // self.page_size:index // self.page_size + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        t, l, h, d = self.page_size, self.layer_num, self.head_num, self.head_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + t] = data_page.reshape(2, l, t, h, d)
        elif self.layout == "page_first":
            self.kv_buffer[:, index:index + t] = data_page.reshape(2, t, l, h, d)
        elif self.layout == "page_first_direct":
            self.kv_buffer[:, index // t:index // t + 1] = data_page.reshape(2, 1, l, t, h, d)
        else:
            self.kv_buffer[:, index // t:index // t + 1] = data_page.reshape(2, 1, h, t, l, d)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base, idx = self.kv_buffer.data_ptr(), indices.tolist()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for i in range(0, len(idx), self.page_size):
                for layer in range(self.layer_num):
                    k = (base + idx[i] * self.head_num * self.head_dim * item
                         + layer * self.size * self.head_num * self.head_dim * item)
                    ptrs += [k, k + v_offset]
            size = item * self.page_size * self.head_num * self.head_dim
        else:
            for i in range(0, len(idx), self.page_size):
                k = base + idx[i] * self.layer_num * self.head_num * self.head_dim * item
                ptrs += [k, k + v_offset]
            size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)


class MLAHostPool:
    """``MLATokenToKVPoolHost`` as a storage backend sees it (no DCP)."""

    def __init__(self, layout: str, *, layer_num: int = 3, kv_lora_rank: int = 12, qk_rope_head_dim: int = 4,
                 page_size: int = 4, page_num: int = 16, dtype: torch.dtype = torch.float32) -> None:
        self.layout, self.layer_num = layout, layer_num
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.page_size, self.page_num, self.size, self.dtype = page_size, page_num, page_num * page_size, dtype
        self.device = "cpu"
        self.pin_memory = False
        c = self.kv_cache_dim
        dims = {"layer_first": (layer_num, self.size, 1, c), "page_first": (self.size, layer_num, 1, c),
                "page_first_direct": (page_num, layer_num, page_size, 1, c)}[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[index:index + self.page_size]
        else:
            page = self.kv_buffer[index // self.page_size:index // self.page_size + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        t, l, c = self.page_size, self.layer_num, self.kv_cache_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, index:index + t] = data_page.reshape(l, t, 1, c)
        elif self.layout == "page_first":
            self.kv_buffer[index:index + t] = data_page.reshape(t, l, 1, c)
        else:
            self.kv_buffer[index // t:index // t + 1] = data_page.reshape(1, l, t, 1, c)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        item, c = self.dtype.itemsize, self.kv_cache_dim
        base, starts = self.kv_buffer.data_ptr(), indices.tolist()[::self.page_size]
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for index in starts:
                ptrs += [base + index * c * item + layer * self.size * c * item for layer in range(self.layer_num)]
            size = item * self.page_size * c
        else:
            ptrs = [base + index * self.layer_num * c * item for index in starts]
            size = self.layer_num * item * self.page_size * c
        return ptrs, [size] * len(ptrs)


def fill(pool: Any, seed: int) -> None:
    """Random values in the whole host pool."""
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.dtype))


def host_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """Token indices of whole host pages (what SGLang's page-aligned host allocator returns)."""
    return torch.tensor([p * page_size + t for p in pages for t in range(page_size)], dtype=torch.int64)


def page_hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's storage page hashes (``get_hash_str``: sha256 over u32le ids, chained)."""
    return [to_hex(h) for h in chain_hashes(tokens, page_size, scheme=SGLANG_SCHEME)]


def hit_query(backend: Any, hashes: list[str], prefix_keys: list[str] | None = None) -> list[str]:
    """``_storage_hit_query``: ``batch_exists`` per 128 pages until a batch falls short."""
    hit: list[str] = []
    for start in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[start:start + STORAGE_BATCH_SIZE]
        n = backend.batch_exists(batch, ExtraInfo(prefix_keys=prefix_keys))
        hit += batch[:n]
        if n < len(batch):
            break
        if prefix_keys is not None:
            prefix_keys = prefix_keys + batch
    return hit


def page_transfer(backend: Any, hashes: list[str], indices: torch.Tensor, page_size: int, *,
                  zero_copy: bool, pool: Any = None, prefix_keys: list[str] | None = None) -> int:
    """``_page_transfer``: load ``hashes`` into ``indices`` per 128 pages; returns pages completed."""
    done = 0
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        idx = indices[i * page_size:(i + len(batch)) * page_size]
        extra = ExtraInfo(prefix_keys=prefix_keys)
        n = _get_zero_copy(backend, batch, idx, extra) if zero_copy else _get_generic(backend, pool, batch, idx)
        done += n
        if n < len(batch):
            break
        if prefix_keys is not None:
            prefix_keys = prefix_keys + batch
    return done


def _get_zero_copy(backend: Any, hashes: list[str], idx: torch.Tensor, extra: ExtraInfo) -> int:
    results = backend.batch_get_v1(hashes, idx, extra)
    n = 0
    for ok in results:
        if not ok:
            break
        n += 1
    return n


def _get_generic(backend: Any, pool: Any, hashes: list[str], idx: torch.Tensor) -> int:
    dst = [pool.get_dummy_flat_data_page() for _ in hashes]
    pages = backend.batch_get(hashes, dst)
    n = 0
    for i, page in enumerate(pages):
        if page is None:
            break
        pool.set_from_flat_data_page(int(idx[i * pool.page_size]), page)
        n += 1
    return n


def page_backup(backend: Any, hashes: list[str], indices: torch.Tensor, page_size: int, *, zero_copy: bool,
                pool: Any = None, prefix_keys: list[str] | None = None) -> int:
    """``_page_backup``: store per 128 pages, stopping at the first failed batch; returns tokens done."""
    done = 0
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        idx = indices[i * page_size:(i + len(batch)) * page_size]
        if zero_copy:
            ok = all(backend.batch_set_v1(batch, idx, ExtraInfo(prefix_keys=prefix_keys)))
        else:
            ok = backend.batch_set(batch, [pool.get_data_page(int(idx[j * page_size])) for j in range(len(batch))])
        if not ok:
            break
        if prefix_keys is not None:
            prefix_keys = prefix_keys + batch
        done += page_size * len(batch)
    return done


def page_tensor(pool: Any, page: int) -> torch.Tensor:
    """One host page's values (a copy), for comparisons."""
    return pool.get_data_page(page * pool.page_size, flat=False).clone()
