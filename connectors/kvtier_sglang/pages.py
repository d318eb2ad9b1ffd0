"""SGLang host-pool pages as kvtier blocks: which layout a page's bytes are in, and where they lie.

One SGLang page (``page_size`` tokens of every layer of this rank's shard) is one kvtier block.
HiCache hands a backend a page in one of two forms, whose byte orders differ:

- the zero-copy form (``interface_v1``): ``host_pool.get_page_buffer_meta(indices)`` gives, per
  page, a list of ``(pointer, size)`` regions of the pinned host pool; the page is their
  concatenation in that order.
- the legacy form: a flat tensor, ``host_pool.get_data_page(index, flat=True)`` on a save and
  what ``set_from_flat_data_page`` reads back on a load.

Both are stored under the kvtier layout that names their axis order, so a block saved through one
form (or by another engine of the same namespace) loads through the other: a layout that differs
from the one wanted is converted on load. Per host-pool layout (``--hicache-mem-layout``)::

    attention  pool layout         regions (v1)                     v1 layout                 flat layout
    MHA        layer_first         K,V of layer 0, K,V of layer 1…  vllm-flash [L,2,T,H,D]    sglang-page-first-direct
    MHA        page_first          K [T,L,H,D], V [T,L,H,D]         sglang-page-first         sglang-page-first
    MHA        page_first_direct   K [L,T,H,D], V [L,T,H,D]         sglang-page-first-direct  sglang-page-first-direct
    MHA        page_head           K [H,T,L,D], V [H,T,L,D]         sglang-page-head          sglang-page-head
    MLA        layer_first         layer 0, layer 1, … [T,C]        mla-latent [L,T,C]        mla-latent
    MLA        page_first          one region [T,L,C]               sglang-mla-page-first     sglang-mla-page-first
    MLA        page_first_direct   one region [L,T,C]               mla-latent                mla-latent

Regions are located inside the pool's own ``kv_buffer`` (a pointer outside it, or a size that does
not add up to one page, is refused), so a wrong pointer can never make the backend touch memory
that is not the pool's. Torch is needed; SGLang is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier_protocol.block import dtype_name
from kvtier_protocol.errors import CodecError, InvalidRequest, LayoutError
from kvtier_protocol.layouts import Geometry, get_layout

# (attention, pool layout) -> (layout of the v1 regions, layout of the legacy flat page)
PAGE_LAYOUTS: dict[tuple[str, str], tuple[str, str]] = {
    ("mha", "layer_first"): ("vllm-flash", "sglang-page-first-direct"),
    ("mha", "page_first"): ("sglang-page-first", "sglang-page-first"),
    ("mha", "page_first_direct"): ("sglang-page-first-direct", "sglang-page-first-direct"),
    ("mha", "page_head"): ("sglang-page-head", "sglang-page-head"),
    ("mla", "layer_first"): ("mla-latent", "mla-latent"),
    ("mla", "page_first"): ("sglang-mla-page-first", "sglang-mla-page-first"),
    ("mla", "page_first_direct"): ("mla-latent", "mla-latent"),
}
"""The host-pool layouts this backend stores, with the kvtier layout of each page form."""


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """What a host pool holds per page.

    Attributes:
        attention: ``"mha"`` or ``"mla"``.
        pool_layout: SGLang's ``--hicache-mem-layout`` of the pool.
        num_layers: layers held (this pipeline stage's, plus packed draft layers).
        page_tokens: tokens per page (SGLang's ``page_size``).
        num_heads: KV heads of this TP rank (MHA; 0 for MLA).
        head_dim: channels per head (MHA; 0 for MLA).
        kv_lora_rank: MLA latent width without the RoPE part (MLA; 0 for MHA).
        rope_dim: MLA RoPE key dims stored after the latent (MLA; 0 for MHA).
        dtype: the pool's element dtype.
    """

    attention: str
    pool_layout: str
    num_layers: int
    page_tokens: int
    num_heads: int
    head_dim: int
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, pool: Any, *, is_mla: bool) -> PoolGeometry:
        """Read a SGLang host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``).

        Raises:
            LayoutError: a pool this backend cannot store exactly: another layout, MHA with K and V
                of different widths, or an MLA row that is not ``kv_lora_rank + qk_rope_head_dim``
                (e.g. packed FP8 rows with scales).
        """
        attention = "mla" if is_mla else "mha"
        layout = getattr(pool, "layout", None)
        if (attention, layout) not in PAGE_LAYOUTS:
            known = sorted(lay for att, lay in PAGE_LAYOUTS if att == attention)
            raise LayoutError(f"kvtier stores {attention} host pools laid out as {known}, not {layout!r}")
        common = {"attention": attention, "pool_layout": layout, "num_layers": int(pool.layer_num),
                  "page_tokens": int(pool.page_size), "dtype": pool.dtype}
        if is_mla:
            rank, rope = int(pool.kv_lora_rank), int(pool.qk_rope_head_dim)
            if int(getattr(pool, "kv_cache_dim", rank + rope)) != rank + rope:
                raise LayoutError(f"MLA rows of {pool.kv_cache_dim} elements are not the latent "
                                  f"({rank}) + RoPE ({rope}) dims kvtier stores")
            return cls(num_heads=0, head_dim=0, kv_lora_rank=rank, rope_dim=rope, **common)
        head_dim = int(pool.head_dim)
        if int(getattr(pool, "v_head_dim", head_dim)) != head_dim:
            raise LayoutError(f"K and V heads of different widths ({head_dim}, {pool.v_head_dim}) are not stored")
        return cls(num_heads=int(pool.head_num), head_dim=head_dim, kv_lora_rank=0, rope_dim=0, **common)

    @property
    def region_layout(self) -> str:
        """kvtier layout of a page's v1 regions, concatenated."""
        return PAGE_LAYOUTS[(self.attention, self.pool_layout)][0]

    @property
    def flat_layout(self) -> str:
        """kvtier layout of a legacy flat page."""
        return PAGE_LAYOUTS[(self.attention, self.pool_layout)][1]

    def shape(self, layout: str) -> tuple[int, ...]:
        """One page's tensor shape in ``layout``."""
        if self.attention == "mla":
            geometry = Geometry(self.num_layers, self.page_tokens, latent_dim=self.kv_lora_rank + self.rope_dim)
        else:
            geometry = Geometry(self.num_layers, self.page_tokens, self.num_heads, self.head_dim)
        return get_layout(layout).shape_for(geometry)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (every form)."""
        return int(np.prod(self.shape(self.flat_layout))) * self.dtype.itemsize

    @property
    def kv_dtype(self) -> str:
        """The pool's dtype by kvtier name (LayoutError for a dtype kvtier does not store)."""
        try:
            return dtype_name(self.dtype)
        except CodecError:
            raise LayoutError(f"host pool dtype {self.dtype} is not a KV dtype kvtier stores") from None


class PoolBytes:
    """Byte views of one page's regions inside a host pool's ``kv_buffer``.

    Args:
        pool: the SGLang host pool (``kv_buffer``, ``get_page_buffer_meta``).
        geometry: its :class:`PoolGeometry`.

    Raises:
        LayoutError: the pool's buffer is not one contiguous CPU tensor.
    """

    def __init__(self, pool: Any, geometry: PoolGeometry) -> None:
        buffer = pool.kv_buffer
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise LayoutError("the host pool's kv_buffer must be one contiguous CPU tensor")
        self._pool = pool
        self._geometry = geometry
        self._base = buffer.data_ptr()
        self._bytes = buffer.detach().reshape(-1).view(torch.uint8).numpy()  # a view: writes land in the pool

    def regions(self, host_indices: Any, num_pages: int) -> list[list[np.ndarray]]:
        """Per page, writable byte views of its regions (``get_page_buffer_meta`` order).

        Raises:
            InvalidRequest: ``host_indices`` are not ``num_pages`` whole pages.
            LayoutError: a region outside the pool's buffer, or regions that are not one page.
        """
        t = self._geometry.page_tokens
        count = int(host_indices.numel()) if isinstance(host_indices, torch.Tensor) else len(host_indices)
        if count != num_pages * t:
            raise InvalidRequest(f"{count} host indices for {num_pages} pages of {t} tokens")
        if num_pages == 0:
            return []
        ptrs, sizes = self._pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(sizes) or len(ptrs) % num_pages:
            raise LayoutError(f"get_page_buffer_meta gave {len(ptrs)} pointers for {num_pages} pages")
        per = len(ptrs) // num_pages
        out: list[list[np.ndarray]] = []
        for p in range(num_pages):
            page = [self._view(int(ptrs[i]), int(sizes[i])) for i in range(p * per, (p + 1) * per)]
            if sum(r.nbytes for r in page) != self._geometry.page_bytes:
                raise LayoutError(f"page regions hold {sum(r.nbytes for r in page)} bytes, "
                                  f"a page is {self._geometry.page_bytes}")
            out.append(page)
        return out

    def _view(self, ptr: int, size: int) -> np.ndarray:
        start = ptr - self._base
        if size <= 0 or start < 0 or start + size > self._bytes.nbytes:
            raise LayoutError(f"a page region [{ptr:#x}, +{size}) lies outside the host pool's buffer")
        return self._bytes[start:start + size]


def read_regions(regions: Sequence[np.ndarray]) -> np.ndarray:
    """One page's bytes, its regions concatenated (a copy: the pool may be reused after this)."""
    return regions[0].copy() if len(regions) == 1 else np.concatenate(regions)


def write_regions(regions: Sequence[np.ndarray], payload: memoryview | np.ndarray) -> None:
    """Copy one page's bytes (``payload``, the regions' concatenation) into its regions."""
    src = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload
    offset = 0
    for region in regions:
        np.copyto(region, src[offset:offset + region.nbytes])
        offset += region.nbytes
    assert offset == src.nbytes, "a page's payload is exactly its regions"
