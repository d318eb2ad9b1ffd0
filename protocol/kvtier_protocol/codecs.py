"""KV codecs: a canonical KV tensor <-> named byte sections (SPEC.md §5).

Canonical tensors are MHA ``[L, 2, H, T, D]`` (dim 1: 0 = K, 1 = V) or MLA ``[L, T, C]``. Codecs:
``raw`` (the tensor's bytes), ``int8``/``int4``/``int2`` (asymmetric min/max, KIVI axes: K one
scale per channel, V one per token) and ``fp8_e4m3`` (one fp32 scale per layer, kv, head; MLA:
per token and group). All math runs in float32 on the tensor's device, with exactly rounded ops
only (no reciprocal multiply, no FMA), so CPU and CUDA write the same bytes. Section geometry
and validation live in the torch-free :mod:`kvtier_protocol.codec_plan`.

Integer sections (MLA: P = 1, H = 1, D = C - rope_dims, and a raw ``rope`` section follows)::

    payload  rows [L][P][H][T], each row = D codes, LSB first, padded to a whole byte
    scales   for l: for part: [H][G][D] ("channel") or [H][T][G] ("token"), scale_dtype LE
    mins     the same order and dtype as scales

Two implementations write the same bytes: the C loops of ``kvtier_protocol._codecs`` (built by
setup.py where a C compiler exists; :data:`NATIVE` says whether it loaded) run for CPU tensors of
float32, bfloat16 and float16, and this module's torch path for everything else (CUDA, fp8
sources) and as the reference (``native=False``). tests/protocol/test_codecs_native.py compares
the two byte for byte. :func:`encode_into` writes the sections straight into a caller's buffer
(a disk tier's pool buffer, issue 25), the integer codecs in one pass of the C loops.

This implementation assumes a little-endian host (bytes are the wire's little-endian order).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvtier_protocol.codec_plan import CODECS, CodecPlan, default_quant, plan_codec, section_lengths
from kvtier_protocol.errors import CodecError
from kvtier_protocol.quant import QuantParams

try:
    from kvtier_protocol import _codecs
except ImportError:  # not built: no C compiler at install time, or another interpreter
    _codecs = None

__all__ = ["CODECS", "NATIVE", "Encoded", "decode", "default_quant", "encode", "encode_into", "section_lengths"]

NATIVE: bool = _codecs is not None
"""True when the C loops of ``kvtier_protocol._codecs`` are available."""
_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14


@dataclass(frozen=True, slots=True)
class Encoded:
    """The output of :func:`encode`.

    Attributes:
        sections: ``(name, bytes)`` in payload order; each a 1-D contiguous uint8 CPU tensor
            (``raw`` on CPU may share memory with the input).
        quant: the parameters actually used (defaults filled in, scale dtype after fall-back),
            ``None`` for ``raw``.
    """

    sections: list[tuple[str, torch.Tensor]]
    quant: QuantParams | None

    @property
    def nbytes(self) -> int:
        """Total encoded size of all sections."""
        return sum(t.numel() for _, t in self.sections)


def _grouped(x: torch.Tensor, dim: int, g: int, fn: Callable[..., torch.Tensor],
             stats: Sequence[torch.Tensor]) -> torch.Tensor:
    """Apply ``fn(values, *stats)`` group-wise along ``dim``; stats hold one entry per group there.

    Full groups go through one view; a ragged last group (n % g) is handled separately.
    """
    full, rest = divmod(x.shape[dim], g)
    out = []
    if full:
        xs = x.narrow(dim, 0, full * g).unflatten(dim, (full, g))
        out.append(fn(xs, *(s.narrow(dim, 0, full).unsqueeze(dim + 1) for s in stats)).flatten(dim, dim + 1))
    if rest:
        out.append(fn(x.narrow(dim, full * g, rest), *(s.narrow(dim, full, 1) for s in stats)))
    return out[0] if len(out) == 1 else torch.cat(out, dim)


def _reduce(x: torch.Tensor, dim: int, g: int, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Per-group ``fn`` (amin/amax: NaN propagates) along ``dim``; the group axis replaces ``dim``."""
    full, rest = divmod(x.shape[dim], g)
    parts = []
    if full:
        parts.append(fn(x.narrow(dim, 0, full * g).unflatten(dim, (full, g)), dim=dim + 1))
    if rest:
        parts.append(fn(x.narrow(dim, full * g, rest), dim=dim, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


# Packing reads the codes of one byte as one little-endian int16 (int4) or int32 (int2) and folds
# them together with shifts: contiguous integer ops, several times faster than strided ones.
def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the last dim of uint8 codes, ``8 // bits`` per byte, first code in the low bits."""
    per = 8 // bits
    if per == 1:
        return codes
    pad = -codes.shape[-1] % per
    if pad:  # each row starts on a byte boundary
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], -1)
    if bits == 4:  # bytes c0 c1 -> c0 | c1 << 4
        s = codes.view(torch.int16)
        s = s | (s >> 4)
    else:  # bytes c0 c1 c2 c3 -> c0 | c1 << 2 | c2 << 4 | c3 << 6
        s = codes.view(torch.int32)
        s = s | (s >> 6)
        s = s | (s >> 12)
    return (s & 0xFF).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: ``n`` codes per row."""
    if bits == 8:
        return packed
    if bits == 4:
        s = packed.to(torch.int16)
        s = (s | (s << 4)) & 0x0F0F
    else:
        s = packed.to(torch.int32)
        s = (s | (s << 12)) & 0x000F000F
        s = (s | (s << 6)) & 0x03030303
    return s.view(torch.uint8)[..., :n]


def _fp8_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes -> float32 times 2^-8, exactly: the bits shifted into a float16 (whose bias is
    8 more). Several times faster than torch's fp8 cast on CPU. NaN codes (0x7F, 0xFF), which no
    encoder writes, come out as +-480 * 2^-8 instead of NaN."""
    i = codes.to(torch.int16)
    return (((i & 0x80) << 8) | ((i & 0x7F) << 7)).view(torch.float16).float()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1).cpu()


def _join(stats: Sequence[torch.Tensor], L: int) -> torch.Tensor:
    """Per-part stats -> one section, layer-major: for l: for part: part's own order."""
    return _bytes(torch.cat([s.reshape(L, -1) for s in stats], 1))


def _split(buf: torch.Tensor, pl: CodecPlan, dtype: torch.dtype) -> list[torch.Tensor]:
    shapes = [pl.stats_shape(p) for p in range(pl.P)]
    flat = buf.view(dtype).reshape(pl.L, -1).float()
    return [s.reshape(shape) for s, shape in zip(flat.split([math.prod(x[1:]) for x in shapes], 1), shapes)]


def _fits_fp16(scales: Sequence[torch.Tensor], mins: Sequence[torch.Tensor]) -> bool:
    """True when float16 holds every scale to full precision and no value overflows."""
    for s, m in zip(scales, mins):
        if bool((s > FP16_MAX).any() | ((s > 0) & (s < FP16_MIN_NORMAL)).any() | (m.abs() > FP16_MAX).any()):
            return False
    return True


def encode(x: torch.Tensor, codec: str, quant: QuantParams | None = None, *, mla: bool = False,
           native: bool | None = None) -> Encoded:
    """Encode a canonical KV tensor into byte sections.

    Args:
        x: MHA ``[L, 2, H, T, D]`` or, when ``mla``, ``[L, T, C]``; any device.
        codec: one of :data:`CODECS`.
        quant: codec parameters; ``None`` takes :func:`default_quant` (MLA: rope_dims 0).
        mla: whether ``x`` is an MLA latent.
        native: ``None`` runs the C loops where they apply (:data:`NATIVE`, a CPU tensor of
            float32/bfloat16/float16), ``False`` always the torch path; the bytes are the same.

    Raises:
        CodecError: bad codec/parameters/shape/dtype, NaN or Inf in ``x`` (quantizing codecs),
            or a value range that overflows float32.
    """
    dtype = str(x.dtype).removeprefix("torch.")
    if codec != "raw" and quant is None:
        quant = default_quant(codec, mla=mla)
    pl = plan_codec(codec, quant, tuple(x.shape), dtype, mla)
    if pl.quant is None:
        return Encoded([("payload", _bytes(x.detach()))], None)
    if _use_native(native, x.device, x.dtype):
        sections, quant = _encode_native(pl, x.detach().contiguous(), pl.quant)
    else:
        xf = x.detach().to(torch.float32)
        enc = _encode_fp8 if codec == "fp8_e4m3" else _encode_int
        sections, quant = enc(pl, xf, pl.quant)
    if pl.R:
        sections.append(("rope", _bytes(x.detach()[:, :, pl.D:])))
    return Encoded(sections, quant)


def encode_into(x: torch.Tensor, codec: str, quant: QuantParams | None = None, *, mla: bool = False,
                alloc: Callable[[int], memoryview], native: bool | None = None,
                ) -> tuple[memoryview, list[tuple[str, int]], QuantParams | None]:
    """:func:`encode`, its sections written back to back into one buffer from ``alloc``.

    The integer codecs on the C loops (:data:`NATIVE`, a CPU tensor of float32/bfloat16/float16)
    encode straight into that buffer in one pass per part (statistics, parameters and codes of
    each group while it is in cache); every other case encodes as :func:`encode` and copies the
    sections in. The bytes are :func:`encode`'s, concatenated.

    Args:
        x, codec, quant, mla, native: as for :func:`encode`.
        alloc: ``alloc(nbytes)`` returns a writable, C-contiguous byte view of ``nbytes`` bytes.
            It may be called more than once (float16 scales that fall back to float32 change the
            sections' lengths, and a block the one-pass loops cannot settle is encoded again the
            long way): only the view returned is in use, the earlier ones are free again.

    Returns:
        The view (exactly the sections' bytes), ``(name, length)`` of each section in payload
        order, and the parameters used (as :attr:`Encoded.quant`).

    Raises:
        CodecError: as :func:`encode`.
    """
    if codec != "raw" and quant is None:
        quant = default_quant(codec, mla=mla)
    pl = plan_codec(codec, quant, tuple(x.shape), str(x.dtype).removeprefix("torch."), mla)
    if pl.quant is not None and codec != "fp8_e4m3" and _use_native(native, x.device, x.dtype):
        got = _encode_int_into(pl, x.detach().contiguous(), pl.quant, alloc)
        if got is not None:
            return got
    enc = encode(x, codec, quant, mla=mla, native=native)
    lengths = [(name, t.numel()) for name, t in enc.sections]
    buf = alloc(sum(n for _, n in lengths))
    mv, off = memoryview(buf), 0
    for (_, t), (_, n) in zip(enc.sections, lengths):
        mv[off:off + n] = t.numpy()
        off += n
    return buf, lengths, enc.quant


def _encode_int_into(pl: CodecPlan, x: torch.Tensor, q: QuantParams, alloc: Callable[[int], memoryview],
                     ) -> tuple[memoryview, list[tuple[str, int]], QuantParams] | None:
    """The integer codecs' one-pass C loop (``_codecs.encode_int``) into a buffer of ``alloc``; None
    when a part has NaN/Inf or a scale overflowing float32 (the caller encodes the long way, which
    raises the error the reference path would)."""
    assert _codecs is not None, "checked by _use_native"
    dt = _NATIVE_DTYPES[x.dtype]
    src = memoryview(x.view(-1).view(torch.uint8).numpy())
    geoms, _ = _geometries(pl)
    rows = pl.P * pl.H * pl.T
    for f16 in (True, False) if q.scale_dtype == "float16" else (False,):
        if not f16 and q.scale_dtype == "float16":
            q = replace(q, scale_dtype="float32")  # recorded in the header: never a silent overflow
            pl = replace(pl, quant=q)
        lengths = pl.lengths()
        buf = alloc(sum(n for _, n in lengths))
        mv, views, off = memoryview(buf), {}, 0
        for name, n in lengths:
            views[name] = mv[off:off + n]
            off += n
        status = 0
        for p, geom in enumerate(geoms):
            status = _codecs.encode_int(src, dt, *geom, q.bits, f16, views["payload"], views["scales"],
                                        views["mins"], p * pl.H * pl.T, rows)
            if status:
                break
        if status == 0:
            if pl.R:
                rope = torch.frombuffer(views["rope"], dtype=torch.uint8).view(x.dtype)
                rope.view(pl.L, pl.T, pl.R).copy_(x[:, :, pl.D:])
            return buf, lengths, q
        if status != 2:
            return None
    return None  # float32 scales never return 2


def _parts(pl: CodecPlan, xf: torch.Tensor) -> list[torch.Tensor]:
    """The quantized parts as ``[L, H, T, D]`` views: K and V, or the MLA latent without rope."""
    return [xf[:, :, : pl.D].unsqueeze(1)] if pl.mla else [xf[:, 0], xf[:, 1]]


def _encode_int(pl: CodecPlan, xf: torch.Tensor, q: QuantParams) -> tuple[list, QuantParams]:
    parts = _parts(pl, xf)
    qmax = float((1 << q.bits) - 1)
    mins = [_reduce(x, dim, g, torch.amin) for x, (dim, g) in zip(parts, pl.groups)]
    maxs = [_reduce(x, dim, g, torch.amax) for x, (dim, g) in zip(parts, pl.groups)]
    _check_finite(mins + maxs)
    scales = [(mx - mn) / qmax for mn, mx in zip(mins, maxs)]
    if not all(bool(torch.isfinite(s).all()) for s in scales):
        raise CodecError("value range of a group overflows float32")
    if q.scale_dtype == "float16" and not _fits_fp16(scales, mins):
        q = replace(q, scale_dtype="float32")  # recorded in the header: never a silent overflow
    sdt = getattr(torch, q.scale_dtype)
    # Codes are computed from the STORED scale and min, so a decoder reproduces the encoder's grid.
    scales = [s.to(sdt) for s in scales]
    mins = [m.to(sdt) for m in mins]

    def quantize(v: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        s = s.float()
        t = v - m.float()
        t.div_(torch.where(s > 0, s, math.inf))  # scale 0 (constant group): every code is 0
        return t.round_().clamp_(0.0, qmax).to(torch.uint8)

    codes = torch.empty((pl.L, pl.P, pl.H, pl.T, pl.D), dtype=torch.uint8, device=parts[0].device)
    for p, (x, (dim, g)) in enumerate(zip(parts, pl.groups)):
        codes[:, p] = _grouped(x, dim, g, quantize, (scales[p], mins[p]))
    return [("payload", _bytes(_pack(codes, q.bits))), ("scales", _join(scales, pl.L)),
            ("mins", _join(mins, pl.L))], q


def _check_finite(stats: Sequence[torch.Tensor]) -> None:
    # Group minima/maxima carry every NaN and Inf of the input: no separate pass over the data.
    if not all(bool(torch.isfinite(s).all()) for s in stats):
        raise CodecError("NaN or Inf in a block; quantizing codecs refuse it")


def _to_fp8(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    y = (v / torch.where(s > 0, s, math.inf)).clamp_(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def _encode_fp8(pl: CodecPlan, xf: torch.Tensor, q: QuantParams) -> tuple[list, QuantParams]:
    if pl.mla:
        (dim, g), part = pl.groups[0], _parts(pl, xf)[0]
        amax = _reduce(part.abs(), dim, g, torch.amax)
        _check_finite([amax])
        scale = amax / FP8_MAX
        return [("payload", _bytes(_grouped(part, dim, g, _to_fp8, (scale,)))), ("scales", _bytes(scale))], q
    amax = xf.abs().amax(dim=(3, 4))  # [L, 2, H]
    _check_finite([amax])
    scale = amax / FP8_MAX
    return [("payload", _bytes(_to_fp8(xf, scale[..., None, None]))), ("scales", _bytes(scale))], q


def _load(buf: object, name: str, length: int) -> torch.Tensor:
    """Copy one untrusted section into a fresh, aligned uint8 tensor after checking its length."""
    try:
        src = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise CodecError(f"section {name!r} is not a contiguous byte buffer: {e}") from None
    if src.size != length:
        raise CodecError(f"section {name!r} has {src.size} bytes, expected {length}")
    out = torch.empty(length, dtype=torch.uint8)
    # A numpy copy into the tensor's memory: torch.frombuffer would warn on read-only input.
    np.copyto(out.numpy(), src)
    return out


def decode(sections: Mapping[str, object], *, codec: str, quant: QuantParams | None,
           shape: Sequence[int], dtype: str, mla: bool = False,
           device: str | torch.device = "cpu", native: bool | None = None) -> torch.Tensor:
    """Decode byte sections into the canonical tensor (original shape and dtype) on ``device``.

    Every section length is checked against :func:`section_lengths` before anything is
    allocated; the section names must be exactly the expected ones. ``native`` as for
    :func:`encode` (the C loops decode on the CPU; the bytes are the same).

    Raises:
        CodecError: bad parameters, missing/extra sections, wrong lengths, non-buffer input.
    """
    pl = plan_codec(codec, quant, shape, dtype, mla)
    want = pl.lengths()
    if set(sections) != {n for n, _ in want}:
        raise CodecError(f"sections {sorted(sections)} != expected {[n for n, _ in want]}")
    buf = {n: _load(sections[n], n, ln).to(device) for n, ln in want}
    tdt = getattr(torch, dtype)
    if pl.codec == "raw":
        return buf["payload"].view(tdt).reshape(pl.shape)
    if _use_native(native, torch.device(device), tdt):
        return _decode_native(pl, buf, tdt)
    parts = (_decode_fp8 if pl.codec == "fp8_e4m3" else _decode_int)(pl, buf)
    out = torch.empty(pl.shape, dtype=tdt, device=device)
    fmax = torch.finfo(tdt).max
    for p, part in enumerate(parts):  # float32 [L, H, T, D]; copy_ casts with round-to-nearest-even
        # Saturate first (NaN stays NaN): q*S + M may round past the dtype's largest finite value
        # (a float16 group spanning +-65504 whose scale rounded up), and a finite block must never
        # decode to Inf (SPEC 5.4).
        part.clamp_(-fmax, fmax)
        (out[:, :, : pl.D] if pl.mla else out[:, p]).copy_(part[:, 0] if pl.mla else part)
    if pl.R:
        out[:, :, pl.D:] = buf["rope"].view(tdt).reshape(pl.L, pl.T, pl.R)
    return out


def _decode_int(pl: CodecPlan, buf: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    assert pl.quant is not None, "planned quantized codec has quant"
    sdt = getattr(torch, pl.quant.scale_dtype)
    scales, mins = _split(buf["scales"], pl, sdt), _split(buf["mins"], pl, sdt)
    rowbytes = -(-pl.D * pl.quant.bits // 8)
    codes = _unpack(buf["payload"].reshape(pl.L, pl.P, pl.H, pl.T, rowbytes), pl.quant.bits, pl.D)

    def dequantize(c: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return (c * s).add_(m)  # two roundings, no FMA: q*scale, then + min

    return [_grouped(codes[:, p], dim, g, dequantize, (scales[p], mins[p]))
            for p, (dim, g) in enumerate(pl.groups)]


def _decode_fp8(pl: CodecPlan, buf: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    def dequantize(c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _fp8_to_float(c) * (s * 256.0)  # 256 = 2^8 undoes _fp8_to_float's scaling exactly

    codes = buf["payload"].reshape(pl.L, pl.P, pl.H, pl.T, pl.D)
    if pl.mla:
        dim, g = pl.groups[0]
        scale = buf["scales"].view(torch.float32).reshape(pl.stats_shape(0))
        return [_grouped(codes[:, 0], dim, g, dequantize, (scale,))]
    scale = buf["scales"].view(torch.float32).reshape(pl.L, pl.P, pl.H, 1, 1)
    return [dequantize(codes[:, p], scale[:, p]) for p in range(pl.P)]


# --- the C loops (kvtier_protocol._codecs) --------------------------------------------------------
# Statistics and codes of each part come from C; the few per-group values in between (scales, the
# float16 fall-back, the stored rounding) are computed by the same torch code as the reference
# path, so the two paths share every rule and differ only in where the element loops run.


def _use_native(native: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    if native is None:
        return _codecs is not None and device.type == "cpu" and dtype in _NATIVE_DTYPES
    if native and (_codecs is None or device.type != "cpu" or dtype not in _NATIVE_DTYPES):
        raise CodecError("the native codec path needs kvtier_protocol._codecs and a CPU tensor of "
                         "float32, bfloat16 or float16")
    return native


def _geometries(pl: CodecPlan) -> tuple[list[tuple[int, ...]], int]:
    """Each part of a canonical tensor as the C loops see it (L, H, T, D, base, sL, sH, sT, dim,
    g, soff, sstride: element offsets into the contiguous tensor, then where the part's statistics
    lie in a per-layer row of all parts'), and that row's length. MHA fp8 (one scale per layer, kv,
    head) runs as one group of D channels per token: statistics ``[L][kv][H][T]``."""
    groups = list(pl.groups) if pl.groups else [(3, pl.D)] * pl.P
    counts = [math.prod(pl.stats_shape(p)[1:]) if pl.groups else pl.H * pl.T for p in range(pl.P)]
    out, soff = [], 0
    for p, ((dim, g), n) in enumerate(zip(groups, counts)):
        if pl.mla:
            C = pl.D + pl.R
            geom = (pl.L, 1, pl.T, pl.D, 0, pl.T * C, 0, C)
        else:
            hd = pl.H * pl.T * pl.D
            geom = (pl.L, pl.H, pl.T, pl.D, p * hd, 2 * hd, pl.T * pl.D, pl.D)
        out.append((*geom, dim, g, soff, sum(counts)))
        soff += n
    return out, sum(counts)


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())


def _encode_native(pl: CodecPlan, x: torch.Tensor, q: QuantParams) -> tuple[list, QuantParams]:
    assert _codecs is not None, "checked by _use_native"
    dt = _NATIVE_DTYPES[x.dtype]
    src = memoryview(x.view(-1).view(torch.uint8).numpy())
    fp8 = pl.codec == "fp8_e4m3"
    geoms, per_layer = _geometries(pl)
    lo = torch.empty(pl.L, per_layer)
    hi = torch.empty(pl.L, per_layer) if not fp8 else lo
    bad = False
    for geom in geoms:
        bad |= _codecs.stats(src, dt, *geom, fp8, _mv(lo), _mv(hi))
    if bad:
        raise CodecError("NaN or Inf in a block; quantizing codecs refuse it")
    rows = pl.P * pl.H * pl.T
    out = torch.empty(pl.L * rows * -(-pl.D * q.bits // 8), dtype=torch.uint8)  # C writes every byte
    if fp8:
        if pl.mla:
            stored = lo / FP8_MAX
            div = torch.where(stored > 0, stored, math.inf)
        else:  # per (layer, kv, head): the largest of its tokens' maxima, repeated for each token
            stored = lo.view(pl.L, pl.P, pl.H, pl.T).amax(3) / FP8_MAX
            div = torch.where(stored > 0, stored, math.inf)[..., None].expand(-1, -1, -1, pl.T).contiguous()
        for p, geom in enumerate(geoms):
            _codecs.quantize(src, dt, *geom, 0, _mv(div), _mv(div), _mv(out), p * pl.H * pl.T, rows)
        return [("payload", out), ("scales", _bytes(stored))], q
    # The per-group values the codes are computed from, in C too (a dozen small torch operations
    # cost a third of a 2 MiB block's encode): the same rules as _encode_int, the same bytes.
    qmax = float((1 << q.bits) - 1)
    n = pl.L * per_layer
    div, mins = torch.empty(n), torch.empty(n)
    for f16 in (True, False) if q.scale_dtype == "float16" else (False,):
        stored_s = torch.empty(n * (2 if f16 else 4), dtype=torch.uint8)
        stored_m = torch.empty_like(stored_s)
        status = _codecs.int_params(_mv(lo), _mv(hi), qmax, f16, _mv(stored_s), _mv(stored_m), _mv(div), _mv(mins))
        if status == 1:
            raise CodecError("value range of a group overflows float32")
        if status == 0:
            break
        q = replace(q, scale_dtype="float32")  # recorded in the header: never a silent overflow
    for p, geom in enumerate(geoms):
        _codecs.quantize(src, dt, *geom, q.bits, _mv(div), _mv(mins), _mv(out), p * pl.H * pl.T, rows)
    return [("payload", out), ("scales", stored_s), ("mins", stored_m)], q


_FP8_TABLE = _fp8_to_float(torch.arange(256, dtype=torch.uint8)).contiguous()
"""The torch path's value of every fp8 code (times 2^-8), so both paths multiply the same floats."""


def _as_f32(t: torch.Tensor) -> torch.Tensor:
    """``t.float()`` by numpy: a block's scales are tens of thousands of values, past torch's grain
    for intra-op threads, and OpenMP workers woken on a busy host cost milliseconds per call (a
    2 MiB int8 decode went from ~1 to ~13 ms in an engine's process so)."""
    return torch.from_numpy(t.numpy().astype(np.float32))


def _decode_native(pl: CodecPlan, buf: dict[str, torch.Tensor], tdt: torch.dtype) -> torch.Tensor:
    assert _codecs is not None and pl.quant is not None, "checked by _use_native and plan_codec"
    out = torch.empty(pl.shape, dtype=tdt)
    dst = memoryview(out.view(-1).view(torch.uint8).numpy())
    dt, fmax = _NATIVE_DTYPES[tdt], float(torch.finfo(tdt).max)
    rows = pl.P * pl.H * pl.T
    geoms, _ = _geometries(pl)
    if pl.codec == "fp8_e4m3":
        bits = 0
        scales = buf["scales"].view(torch.float32)
        if not pl.mla:  # one scale per (layer, kv, head), repeated for each token as the loops read it
            scales = scales.reshape(pl.L, pl.P, pl.H, 1).expand(-1, -1, -1, pl.T).contiguous()
        mins = scales
    else:
        bits, sdt = pl.quant.bits, getattr(torch, pl.quant.scale_dtype)
        scales, mins = _as_f32(buf["scales"].view(sdt)), _as_f32(buf["mins"].view(sdt))
    codes, table = _mv(buf["payload"]), _mv(_FP8_TABLE)
    for p, geom in enumerate(geoms):
        _codecs.dequantize(codes, bits, p * pl.H * pl.T, rows, _mv(scales), _mv(mins), table, dst, dt, fmax, *geom)
    if pl.R:
        out[:, :, pl.D:] = buf["rope"].view(tdt).reshape(pl.L, pl.T, pl.R)
    return out
