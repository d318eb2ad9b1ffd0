"""Codec names, default parameters and section geometry (SPEC.md §5). Torch-free.

Everything a decoder must know about a quantized block before it touches the payload: which
sections exist, in which order, and their exact byte lengths. The header decoder can call
:func:`section_lengths` without importing torch; :mod:`kvtier_protocol.codecs` does the math.

Geometry: the quantized parts are seen as ``[L, H, T, D]`` tensors; MHA has two parts (K, V),
MLA one (the latent without its rope dims, with ``H = 1`` and ``D = C - rope_dims``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier_protocol.dtypes import DTYPE_SIZES, FLOAT_DTYPES, check_dtype
from kvtier_protocol.errors import CodecError
from kvtier_protocol.quant import QuantParams

CODECS = ("raw", "int8", "int4", "int2", "fp8_e4m3")
"""Every codec name of format version 1."""

CODEC_BITS = {"int8": 8, "int4": 4, "int2": 2, "fp8_e4m3": 8}
"""Code width of each quantizing codec (``quant.bits`` must match)."""

MHA_GROUP = {"int8": 0, "int4": 32, "int2": 32, "fp8_e4m3": 0}
"""Default MHA group size per codec (0 = the whole axis)."""

MLA_GROUP = 128
"""Default MLA group along the latent (FlashMLA's fp8 format has one scale per 128 values)."""

SCALE_SIZE = {"float16": 2, "float32": 4}


@dataclass(frozen=True, slots=True)
class CodecPlan:
    """The validated geometry of one encoded block.

    Attributes:
        codec: the codec name.
        quant: its parameters (``None`` for ``raw``).
        shape: the canonical tensor shape.
        dtype: the canonical tensor dtype name.
        mla: whether the tensor is an MLA latent ``[L, T, C]``.
        L: layers.
        P: quantized parts: 2 (K, V) or 1 (MLA latent).
        H: heads (1 for MLA).
        T: tokens.
        D: quantized width of one row: head_dim, or ``C - rope_dims`` for MLA.
        R: MLA rope dims kept raw.
        groups: per part, ``(dim, g)``: the reduced dim of ``[L, H, T, D]`` (2: over tokens,
            the "channel" axis; 3: over channels, the "token" axis) and the effective group size
            (``min(group, axis)``, the whole axis for 0). Empty for ``raw`` and MHA fp8.
    """

    codec: str
    quant: QuantParams | None
    shape: tuple[int, ...]
    dtype: str
    mla: bool
    L: int
    P: int
    H: int
    T: int
    D: int
    R: int
    groups: tuple[tuple[int, int], ...]

    def stats_shape(self, part: int) -> tuple[int, ...]:
        """Shape of one part's scales (and mins), outermost first, layer axis included."""
        if not self.groups:  # MHA fp8: one scale per (layer, head) of each part
            return (self.L, self.H)
        dim, g = self.groups[part]
        if dim == 2:
            return (self.L, self.H, -(-self.T // g), self.D)
        return (self.L, self.H, self.T, -(-self.D // g))

    def lengths(self) -> list[tuple[str, int]]:
        """``(name, byte length)`` of every section, in payload order."""
        esize = DTYPE_SIZES[self.dtype]
        if self.quant is None:
            return [("payload", math.prod(self.shape) * esize)]
        nstats = self.L * sum(math.prod(self.stats_shape(p)[1:]) for p in range(self.P))
        rows = self.L * self.P * self.H * self.T
        if self.codec == "fp8_e4m3":
            out = [("payload", rows * self.D), ("scales", nstats * 4)]
        else:
            ssize = SCALE_SIZE[self.quant.scale_dtype]
            rowbytes = -(-self.D * self.quant.bits // 8)
            out = [("payload", rows * rowbytes), ("scales", nstats * ssize), ("mins", nstats * ssize)]
        if self.R:
            out.append(("rope", self.L * self.T * self.R * esize))
        return out


def default_quant(codec: str, *, mla: bool = False, rope_dims: int = 0) -> QuantParams | None:
    """The parameters an encoder uses when given none (``None`` for ``raw``).

    MHA: K per channel, V per token; whole-axis groups for int8, groups of 32 for int4/int2;
    float16 scales (fp8: float32, one per layer/kv/head). MLA: per token, groups of
    :data:`MLA_GROUP` along the latent, the last ``rope_dims`` latent dims kept raw.

    Raises:
        CodecError: unknown codec.
    """
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if codec == "raw":
        return None
    sdt = "float32" if codec == "fp8_e4m3" else "float16"
    if mla:
        return QuantParams(CODEC_BITS[codec], "token", "token", MLA_GROUP, MLA_GROUP, sdt, rope_dims)
    g = MHA_GROUP[codec]
    return QuantParams(CODEC_BITS[codec], "channel", "token", g, g, sdt, 0)


def plan_codec(codec: str, quant: QuantParams | None, shape: Sequence[int], dtype: str,
               mla: bool = False) -> CodecPlan:
    """Validate a codec's parameters against a tensor's shape and dtype.

    Raises:
        CodecError: unknown codec or dtype, a shape that is not canonical, quant missing (or
            given for raw), bits not matching the codec, a group size that would not start on a
            byte boundary, rope dims outside MLA, fp8 with float16 scales.
    """
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")
    check_dtype(dtype, CodecError)
    shape = tuple(shape)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise CodecError(f"shape must be positive integers, got {shape!r}")
    if mla:
        if len(shape) != 3:
            raise CodecError(f"MLA shape must be [L, T, C], got {shape}")
        (L, T, C), P, H = shape, 1, 1
    else:
        if len(shape) != 5 or shape[1] != 2:
            raise CodecError(f"MHA shape must be [L, 2, H, T, D], got {shape}")
        L, _, H, T, C = shape
        P = 2
    if codec == "raw":
        if quant is not None:
            raise CodecError("codec raw takes no quant parameters")
        return CodecPlan(codec, None, shape, dtype, mla, L, P, H, T, C, 0, ())
    if dtype not in FLOAT_DTYPES:
        raise CodecError(f"codec {codec} needs a floating dtype, got {dtype}")
    if not isinstance(quant, QuantParams) or quant.bits != CODEC_BITS[codec]:
        raise CodecError(f"codec {codec} needs quant parameters with bits={CODEC_BITS[codec]}")
    R = quant.rope_dims
    if R and (not mla or R >= C):
        raise CodecError(f"rope_dims={R} needs MLA and fewer than C={C} latent dims")
    axes = [(quant.k_axis, quant.k_group)]
    if not mla:
        axes.append((quant.v_axis, quant.v_group))
    if codec == "fp8_e4m3":
        if quant.scale_dtype != "float32":
            raise CodecError("fp8_e4m3 scales are float32")
        if mla and quant.k_axis != "token":
            raise CodecError("MLA fp8_e4m3 groups run along the latent (k_axis 'token')")
        if not mla:
            axes = []  # one scale per (layer, kv, head); the axis and group fields are ignored
    groups = []
    for axis, g in axes:
        if g % (8 // quant.bits):
            raise CodecError(f"group {g} must be a multiple of {8 // quant.bits} at {quant.bits} bits")
        dim = 2 if axis == "channel" else 3
        n = T if dim == 2 else C - R
        groups.append((dim, n if g == 0 or g > n else g))
    return CodecPlan(codec, quant, shape, dtype, mla, L, P, H, T, C - R, R, tuple(groups))


def section_lengths(codec: str, quant: QuantParams | None, shape: Sequence[int], dtype: str,
                    mla: bool = False) -> list[tuple[str, int]]:
    """The exact ``(name, byte length)`` of every section, in payload order.

    Raises:
        CodecError: as :func:`plan_codec`.
    """
    return plan_codec(codec, quant, shape, dtype, mla).lengths()
