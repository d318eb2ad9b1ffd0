"""Engine pages <-> block tensors: gather a block out of paged per-layer KV caches, scatter it back.

An engine keeps one cache tensor per layer, cut into pages of ``T`` tokens; page ``p`` of every
layer together is one kvtier block. The page layout names where the page axis sits in a layer's
cache and which kvtier block layout (:mod:`kvtier_protocol.layouts`) stacking the layers gives::

    page layout   per-layer cache      one page of a layer   block (layers stacked)   block layout
    vllm-flash    (2, P, T, H, D)      c[:, p] (2, T, H, D)  [L, 2, T, H, D]          vllm-flash
    vllm-nhc      (P, T, H, 2D)        c[p]    (T, H, 2D)    [L, T, H, 2D]            vllm-nhc
    mla-latent    (P, T, C)            c[p]    (T, C)        [L, T, C]                mla-latent

Gather and scatter are pure copies (no arithmetic), so a block round-trips bit-exactly, and they
run on the caches' own device with one indexed copy per layer for a whole batch of pages.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier_protocol.block import dtype_name
from kvtier_protocol.errors import InvalidRequest, LayoutError
from kvtier_protocol.namespace import Namespace


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Where the pages sit in an engine's per-layer KV cache.

    Attributes:
        name: the page layout's name (a key of :data:`PAGE_LAYOUTS`).
        block_layout: the kvtier layout of a gathered block (layers stacked first).
        page_axis: the axis of a per-layer cache tensor that indexes pages.
        is_mla: whether the cache holds an MLA latent (one vector per token, no heads).
    """

    name: str
    block_layout: str
    page_axis: int
    is_mla: bool

    def page_shape(self, ns: Namespace) -> tuple[int, ...]:
        """One layer's page (the cache with its page axis removed) for namespace ``ns``.

        Raises:
            LayoutError: the layout does not fit the namespace's attention (MHA vs MLA), or MHA
                K and V head dims differ (no supported page layout stores that).
        """
        if self.is_mla != (ns.attention == "mla"):
            raise LayoutError(f"page layout {self.name} does not hold {ns.attention} KV")
        t = ns.block_tokens
        if self.is_mla:
            return (t, ns.head_dim + ns.mla_rope_dim)
        if ns.head_dim_v != ns.head_dim:
            raise LayoutError(f"page layout {self.name} needs equal K and V head dims, "
                              f"got {ns.head_dim} and {ns.head_dim_v}")
        h, d = ns.num_kv_heads, ns.head_dim
        return (2, t, h, d) if self.name == "vllm-flash" else (t, h, 2 * d)

    def block_shape(self, ns: Namespace) -> tuple[int, ...]:
        """One block in :attr:`block_layout`: the page shape of every layer, layers first."""
        return (ns.num_layers, *self.page_shape(ns))

    def cache_shape(self, ns: Namespace, num_pages: int) -> tuple[int, ...]:
        """A per-layer cache of ``num_pages`` pages (what an engine allocates)."""
        page = list(self.page_shape(ns))
        page.insert(self.page_axis, num_pages)
        return tuple(page)


PAGE_LAYOUTS: dict[str, PageLayout] = {
    "vllm-flash": PageLayout("vllm-flash", "vllm-flash", page_axis=1, is_mla=False),
    "vllm-nhc": PageLayout("vllm-nhc", "vllm-nhc", page_axis=0, is_mla=False),
    "mla-latent": PageLayout("mla-latent", "mla-latent", page_axis=0, is_mla=True),
}
"""Every page layout the connector core gathers from and scatters into, by name."""


def get_page_layout(name: str | PageLayout) -> PageLayout:
    """Resolve a page layout name (or pass a :class:`PageLayout` through).

    Raises:
        LayoutError: unknown name.
    """
    if isinstance(name, PageLayout):
        return name
    found = PAGE_LAYOUTS.get(name) if isinstance(name, str) else None
    if found is None:
        raise LayoutError(f"unknown page layout {name!r}; expected one of {sorted(PAGE_LAYOUTS)}")
    return found


def check_caches(caches: Sequence[torch.Tensor], layout: PageLayout, ns: Namespace) -> int:
    """Check per-layer engine caches against the namespace; returns the number of pages.

    Raises:
        LayoutError: wrong number of layers, a shape, dtype or device that does not match.
    """
    if len(caches) != ns.num_layers:
        raise LayoutError(f"{len(caches)} cache tensors for {ns.num_layers} layers")
    first = caches[0]
    if first.dim() <= layout.page_axis:
        raise LayoutError(f"a {layout.name} cache has a page axis {layout.page_axis}; got shape {tuple(first.shape)}")
    want = layout.cache_shape(ns, first.shape[layout.page_axis])
    for i, c in enumerate(caches):
        if tuple(c.shape) != want:
            raise LayoutError(f"layer {i} cache has shape {tuple(c.shape)}, expected {want} ({layout.name})")
        if c.dtype != first.dtype or c.device != first.device:
            raise LayoutError(f"layer {i} cache is {c.dtype} on {c.device}; layer 0 is {first.dtype} on {first.device}")
    if dtype_name(first.dtype) != ns.kv_dtype:
        raise LayoutError(f"caches hold {dtype_name(first.dtype)}, the namespace says {ns.kv_dtype}")
    return want[layout.page_axis]


def page_index(page_ids: Sequence[int], num_pages: int, device: torch.device) -> torch.Tensor:
    """Page ids as an int64 index on ``device``.

    Raises:
        InvalidRequest: an id outside ``[0, num_pages)`` or a repeated id.
    """
    try:
        ids = [operator.index(p) for p in page_ids]  # numpy/torch ints too, never floats
    except TypeError:
        raise InvalidRequest("page ids must be integers") from None
    if bad := [p for p in ids if not 0 <= p < num_pages]:
        raise InvalidRequest(f"page ids must be in [0, {num_pages}), got {bad[:8]}")
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"page ids must be distinct, got {len(ids) - len(set(ids))} repeated")
    return torch.tensor(ids, dtype=torch.int64, device=device)


def gather_block(caches: Sequence[torch.Tensor], page_id: int, layout: PageLayout) -> torch.Tensor:
    """Block of page ``page_id``: that page of every layer, stacked (``[L, *page]``)."""
    return torch.stack([c.select(layout.page_axis, page_id) for c in caches])


def gather_blocks(caches: Sequence[torch.Tensor], index: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Blocks of the pages in ``index`` as one contiguous tensor ``[n, L, *page]`` on the caches' device.

    One indexed copy per layer for the whole batch, instead of one per layer and page.
    """
    first = caches[0]
    page = list(first.shape)
    del page[layout.page_axis]
    out = torch.empty((index.numel(), len(caches), *page), dtype=first.dtype, device=first.device)
    for i, c in enumerate(caches):
        out[:, i].copy_(c.index_select(layout.page_axis, index).movedim(layout.page_axis, 0))
    return out


def scatter_blocks(caches: Sequence[torch.Tensor], index: torch.Tensor, blocks: torch.Tensor,
                   layout: PageLayout) -> None:
    """Write ``blocks`` (``[n, L, *page]``, any device) into the pages in ``index``, every layer."""
    blocks = blocks.to(caches[0].device)
    for i, c in enumerate(caches):
        c.index_copy_(layout.page_axis, index, blocks[:, i].movedim(0, layout.page_axis))


def host_views(caches: Sequence[torch.Tensor]) -> list[np.ndarray] | None:
    """Byte views of CPU caches, through which :func:`write_page_bytes` copies raw records straight
    into pages; None for caches off the CPU (or without a dense last axis)."""
    if caches[0].device.type != "cpu" or any(c.stride(-1) != 1 for c in caches):
        return None
    return [c.detach().view(torch.uint8).numpy() for c in caches]


def write_page_bytes(views: Sequence[np.ndarray], page_id: int, payload: memoryview, layout: PageLayout) -> None:
    """Copy one raw record payload (a block in ``layout.block_layout`` of the caches' dtype) into page
    ``page_id`` of every layer: one copy from the record to the pages, no tensor in between."""
    page = views[0].shape[:layout.page_axis] + views[0].shape[layout.page_axis + 1:]
    src = np.frombuffer(payload, dtype=np.uint8).reshape(len(views), *page)
    at = (slice(None),) * layout.page_axis + (page_id,)
    for view, layer in zip(views, src):
        np.copyto(view[at], layer)
