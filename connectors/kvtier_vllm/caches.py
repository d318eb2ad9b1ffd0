"""vLLM's registered KV caches as the connector core's page layouts, without copying.

vLLM 0.33 hands ``register_kv_caches`` one strided view per layer, ``[B, H, N, C]`` (blocks,
KV heads, tokens, K‖V content), whatever the physical order of the backing buffer (LBNHC,
LBHNC, ...). Older releases hand the FlashAttention ``(2, B, N, H, D)``, FlashInfer
``(B, 2, N, H, D)`` or MLA ``(B, N, C)`` tensors. Each becomes a view in a core page layout::

    vLLM tensor          view                        core page layout
    [B, H, N, C]  MHA    t.transpose(1, 2)           vllm-nhc   (P, T, H, 2D)
    [B, 1, N, C]  MLA    t[:, 0]                     mla-latent (P, T, C)
    (2, B, N, H, D)      t                           vllm-flash (2, P, T, H, D)
    (B, 2, N, H, D)      t.transpose(0, 1)           vllm-flash
    (B, N, C)     MLA    t                           mla-latent

The views alias vLLM's memory, so the core's gathers read and its scatters write the engine's
pages. When kernel blocks are smaller than vLLM's blocks (``prepare_kernel_block_sizes``),
``r`` consecutive kernel blocks make one vLLM block; they are merged into one page where the
memory allows a view, never by a copy (a copy would load KV into memory the engine never reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvtier_protocol.errors import LayoutError

from kvtier_vllm.config import Geometry


@dataclass(frozen=True, slots=True)
class PagedCaches:
    """The engine's caches as core pages.

    Attributes:
        page_layout: the core page layout name (``vllm-nhc``, ``vllm-flash``, ``mla-latent``).
        caches: one view per layer, in the geometry's layer order.
    """

    page_layout: str
    caches: list[torch.Tensor]


def _merge_blocks(t: torch.Tensor, page_axis: int, token_axis: int, r: int) -> torch.Tensor:
    """View ``t`` with every ``r`` consecutive blocks on ``page_axis`` as one block of ``r`` times the tokens.

    Raises:
        LayoutError: the blocks are not adjacent in memory (e.g. an HND physical layout), so no view exists.
    """
    if r == 1:
        return t
    shape, stride = list(t.shape), list(t.stride())
    if shape[page_axis] % r or stride[page_axis] != shape[token_axis] * stride[token_axis]:
        raise LayoutError(f"kernel blocks of {shape[token_axis]} tokens cannot be viewed as vLLM blocks of "
                          f"{r * shape[token_axis]} (shape {tuple(shape)}, strides {tuple(stride)}); "
                          "use a block size the attention kernel supports")
    shape[page_axis] //= r
    stride[page_axis] *= r
    shape[token_axis] *= r
    return t.as_strided(shape, stride, t.storage_offset())


def _page_view(t: torch.Tensor, geometry: Geometry) -> tuple[str, torch.Tensor]:
    """One layer's tensor as ``(page layout, view)``."""
    n, c = geometry.block_size, geometry.head_size + geometry.head_size_v
    if geometry.mla:
        if t.dim() == 4 and t.shape[1] == 1 and t.shape[3] == c:
            t = t.select(1, 0)
        if t.dim() == 3 and t.shape[2] == c and n % t.shape[1] == 0:
            return "mla-latent", _merge_blocks(t, 0, 1, n // t.shape[1])
    elif t.dim() == 4 and t.shape[1] == geometry.num_kv_heads and t.shape[3] == c and n % t.shape[2] == 0:
        view = t.transpose(1, 2)  # [B, H, N, C] -> [B, N, H, C]
        return "vllm-nhc", _merge_blocks(view, 0, 1, n // view.shape[1])
    elif t.dim() == 5 and t.shape[3] == geometry.num_kv_heads and t.shape[4] == geometry.head_size:
        if t.shape[0] != 2 and t.shape[1] == 2:
            t = t.transpose(0, 1)  # FlashInfer (B, 2, N, H, D)
        if t.shape[0] == 2 and n % t.shape[2] == 0:
            return "vllm-flash", _merge_blocks(t, 1, 2, n // t.shape[2])
    raise LayoutError(f"KV cache of shape {tuple(t.shape)} is none of the layouts kvtier_vllm reads "
                      f"({'MLA' if geometry.mla else 'MHA'}, {geometry.num_kv_heads} KV heads, head size "
                      f"{geometry.head_size}+{geometry.head_size_v}, block size {n})")


def paged_caches(kv_caches: Mapping[str, torch.Tensor], geometry: Geometry) -> PagedCaches:
    """The registered caches of the geometry's layers, as views in one core page layout.

    Raises:
        LayoutError: a layer of the KV-cache group is missing, a tensor is in no known layout,
            or the layers are in different layouts.
    """
    if missing := [name for name in geometry.layer_names if name not in kv_caches]:
        raise LayoutError(f"register_kv_caches lacks layers {missing[:4]} of the KV-cache group")
    views = [_page_view(kv_caches[name], geometry) for name in geometry.layer_names]
    layouts = {layout for layout, _ in views}
    if len(layouts) != 1:
        raise LayoutError(f"layers are in different layouts {sorted(layouts)}")
    return PagedCaches(layouts.pop(), [view for _, view in views])
