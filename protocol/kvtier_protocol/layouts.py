"""Block layouts: named axes of one block's tensor, and exact conversion between them (SPEC.md §6).

A layout names the axis order of the tensor that holds ONE block (all layers, ``T`` tokens) as an
engine keeps it, so a connector can copy a block out of its paged KV cache without reordering, and
a consumer with another engine converts on load. Axis names and sizes:

=========  ===========================================  =======================
axis       meaning                                      size
=========  ===========================================  =======================
``layer``  transformer layer                            ``L``
``kv``     0 = K, 1 = V                                 2
``head``   KV head (of this shard)                      ``H``
``token``  token position inside the block              ``T``
``dim``    channel of one head                          ``D``
``kvdim``  K channels then V channels, concatenated     ``2*D``
``latent`` MLA latent (kv_lora_rank + rope dims)        ``C``
=========  ===========================================  =======================

Conversions are pure permute/reshape followed by one ``contiguous()`` copy, so they are bitwise
exact in both directions. MHA layouts convert among themselves, MLA layouts among themselves.

This module does not import torch: it only calls tensor methods (``permute``, ``reshape``,
``contiguous``), which keeps the layout table importable by the torch-free header decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier_protocol.errors import LayoutError

if TYPE_CHECKING:
    import torch

AXES = ("layer", "kv", "head", "token", "dim", "kvdim", "latent")
"""Every axis name a layout may use."""

MAX_DIM = 1 << 31
"""Upper bound on any one axis size; a larger declared size is refused (it cannot be a real block)."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """Sizes of a block's axes, independent of their order.

    Attributes:
        num_layers: ``L``.
        num_tokens: ``T``, tokens in the block.
        num_heads: ``H``, KV heads (MHA only; 0 for MLA).
        head_dim: ``D``, channels per head, equal for K and V (MHA only; 0 for MLA).
        latent_dim: ``C``, MLA latent width (MLA only; 0 for MHA).
    """

    num_layers: int
    num_tokens: int
    num_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0

    def size_of(self, axis: str) -> int:
        """The size of one named axis under this geometry."""
        sizes = {"layer": self.num_layers, "kv": 2, "head": self.num_heads,
                 "token": self.num_tokens, "dim": self.head_dim, "kvdim": 2 * self.head_dim,
                 "latent": self.latent_dim}
        return sizes[axis]


@dataclass(frozen=True, slots=True)
class Layout:
    """One named axis order of a block tensor.

    Attributes:
        name: the wire name (the header's ``layout`` value).
        axes: axis names, outermost first.
        source: where the engine keeps a block in this order (documentation only).
    """

    name: str
    axes: tuple[str, ...]
    source: str

    @property
    def is_mla(self) -> bool:
        """True for the MLA latent layouts (axis ``latent``)."""
        return "latent" in self.axes

    @property
    def token_axis(self) -> int:
        """Index of the ``token`` axis."""
        return self.axes.index("token")

    @property
    def canonical_name(self) -> str:
        """The canonical layout of this kind: ``"mla-latent"`` or ``"canonical"``."""
        return "mla-latent" if self.is_mla else "canonical"

    def shape_for(self, geometry: Geometry) -> tuple[int, ...]:
        """The tensor shape of one block of ``geometry`` in this layout.

        Raises:
            LayoutError: the geometry lacks a size this layout needs (e.g. MHA sizes for MLA).
        """
        shape = tuple(geometry.size_of(a) for a in self.axes)
        if any(s < 1 for s in shape):
            raise LayoutError(f"geometry {geometry} has no size for every axis of {self.name} {self.axes}")
        return shape

    def geometry_of(self, shape: Sequence[int]) -> Geometry:
        """Infer and check the geometry of a tensor shape declared in this layout.

        Raises:
            LayoutError: wrong rank, a size < 1 or above :data:`MAX_DIM`, ``kv`` not 2, odd ``kvdim``.
        """
        shape = tuple(shape)
        if len(shape) != len(self.axes):
            raise LayoutError(f"layout {self.name} has axes {self.axes}; shape {shape} has rank {len(shape)}")
        for axis, size in zip(self.axes, shape):
            if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_DIM:
                raise LayoutError(f"layout {self.name}: axis {axis} has size {size!r}, not in [1, 2^31]")
        by_axis = dict(zip(self.axes, shape))
        if by_axis.get("kv", 2) != 2:
            raise LayoutError(f"layout {self.name}: axis kv must have size 2, got {by_axis['kv']}")
        if by_axis.get("kvdim", 0) % 2:
            raise LayoutError(f"layout {self.name}: axis kvdim must be even (K then V), got {by_axis['kvdim']}")
        if self.is_mla:
            return Geometry(by_axis["layer"], by_axis["token"], latent_dim=by_axis["latent"])
        head_dim = by_axis["dim"] if "dim" in by_axis else by_axis["kvdim"] // 2
        return Geometry(by_axis["layer"], by_axis["token"], by_axis["head"], head_dim)


def _layouts(*items: Layout) -> dict[str, Layout]:
    return {item.name: item for item in items}


LAYOUTS: dict[str, Layout] = _layouts(
    Layout("canonical", ("layer", "kv", "head", "token", "dim"),
           "kvtier's canonical MHA block; the order the quantizing codecs work in"),
    Layout("vllm-nhc", ("layer", "token", "head", "kvdim"),
           "vLLM >= 0.33 LBNHC (NHD): per layer [B, N, H, Dk+Dv], block b of every layer"),
    Layout("vllm-hnc", ("layer", "head", "token", "kvdim"),
           "vLLM >= 0.33 LBHNC (HND): per layer [B, H, N, Dk+Dv], block b of every layer"),
    Layout("vllm-flash", ("layer", "kv", "token", "head", "dim"),
           "vLLM < 0.33 FlashAttention [2, B, N, H, D] (also FlashInfer [B, 2, N, H, D]) per layer"),
    Layout("sglang-page-first", ("kv", "token", "layer", "head", "dim"),
           "SGLang host pool page_first [2, tokens, L, H, D]: the page's token range"),
    Layout("sglang-page-first-direct", ("kv", "layer", "token", "head", "dim"),
           "SGLang host pool page_first_direct [2, pages, L, T, H, D]: one page (also a layer_first page)"),
    Layout("sglang-page-head", ("kv", "head", "token", "layer", "dim"),
           "SGLang host pool page_head [2, pages, H, T, L, D]: one page"),
    Layout("mla-latent", ("layer", "token", "latent"),
           "canonical MLA block; vLLM MLA pages (H=1 squeezed) of every layer; SGLang MLA "
           "layer_first / page_first_direct pages"),
    Layout("sglang-mla-page-first", ("token", "layer", "latent"),
           "SGLang MLA host pool page_first [tokens, L, 1, C] with H=1 squeezed: the page's token range"),
)
"""Every layout a v1 block may be stored in, by wire name."""


def get_layout(layout: str | Layout) -> Layout:
    """Resolve a layout name (or pass a :class:`Layout` through).

    Raises:
        LayoutError: unknown name.
    """
    if isinstance(layout, Layout):
        return layout
    found = LAYOUTS.get(layout) if isinstance(layout, str) else None
    if found is None:
        raise LayoutError(f"unknown layout {layout!r}; expected one of {sorted(LAYOUTS)}")
    return found


def _expanded_axes(layout: Layout) -> tuple[str, ...]:
    """Axes with ``kvdim`` split into ``kv, dim`` (K is the first half of the concatenated axis)."""
    out: list[str] = []
    for axis in layout.axes:
        out.extend(("kv", "dim") if axis == "kvdim" else (axis,))
    return tuple(out)


def convert(tensor: torch.Tensor, src: str | Layout, dst: str | Layout) -> torch.Tensor:
    """Reorder one block's tensor from layout ``src`` to layout ``dst``, exactly.

    The result is contiguous. When ``src == dst`` the input is returned (made contiguous);
    otherwise the data is copied once.

    Raises:
        LayoutError: unknown layout, MHA <-> MLA conversion, or a shape that does not fit ``src``.
    """
    src, dst = get_layout(src), get_layout(dst)
    if src.name == dst.name and src.is_mla == dst.is_mla:
        src.geometry_of(tuple(tensor.shape))  # the shape must fit
        return tensor.contiguous()  # the input itself when it is contiguous already
    return convert_many(tensor.unsqueeze(0), src, dst)[0]


def convert_many(blocks: torch.Tensor, src: str | Layout, dst: str | Layout, *,
                 contiguous: bool = True) -> torch.Tensor:
    """:func:`convert` of every block of a stacked ``[n, *block]`` tensor, in one operation.

    One permute of the whole batch instead of one per block: a block's inner runs are short (a
    head's ``D`` elements), and torch pays its per-call overhead (thread pool wake-ups included,
    which cost milliseconds per call on a busy 2-core host) once instead of ``n`` times.

    Args:
        contiguous: copy into a contiguous tensor (False: a strided view when the layouts differ,
            for a caller that copies it somewhere anyway, e.g. into an engine's pages).

    Raises:
        LayoutError: unknown layout, MHA <-> MLA conversion, or a shape that does not fit ``src``.
    """
    src, dst = get_layout(src), get_layout(dst)
    if src.is_mla != dst.is_mla:
        raise LayoutError(f"cannot convert between MHA and MLA layouts ({src.name} -> {dst.name})")
    if blocks.dim() < 1:
        raise LayoutError("convert_many needs a stacked [n, *block] tensor")
    n = blocks.shape[0]
    geometry = src.geometry_of(tuple(blocks.shape[1:]))
    if src.name == dst.name:
        return blocks.contiguous() if contiguous else blocks
    x = blocks
    if "kvdim" in src.axes:
        i = 1 + src.axes.index("kvdim")
        x = x.reshape(tuple(x.shape[:i]) + (2, geometry.head_dim) + tuple(x.shape[i + 1:]))
    src_axes, dst_axes = _expanded_axes(src), _expanded_axes(dst)
    x = x.permute([0] + [1 + src_axes.index(a) for a in dst_axes])
    if "kvdim" in dst.axes:
        # kv and dim are adjacent and contiguous after a contiguous permute: a view then.
        x = x.contiguous().reshape((n, *dst.shape_for(geometry)))
    return x.contiguous() if contiguous else x


def to_canonical(tensor: torch.Tensor, layout: str | Layout) -> torch.Tensor:
    """Convert a block from ``layout`` to ``"canonical"`` (MHA) or ``"mla-latent"`` (MLA)."""
    layout = get_layout(layout)
    return convert(tensor, layout, layout.canonical_name)


def from_canonical(tensor: torch.Tensor, layout: str | Layout) -> torch.Tensor:
    """Convert a block from the canonical layout of ``layout``'s kind to ``layout``."""
    layout = get_layout(layout)
    return convert(tensor, layout.canonical_name, layout)
