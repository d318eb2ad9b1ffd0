"""The C loops of kvtier_protocol._codecs against the torch reference path: the same bytes.

Every codec, every source dtype the C loops take (float32, bfloat16, float16), MHA and MLA
(with and without rope dims), both axes, ragged groups, constant groups, the float32-scale
fall-back, and decoding of random section bytes (garbage scales included). The golden vectors
(test_vectors_blocks.py) decode through whichever path runs by default.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.bench.codecs import synthetic_kv
from kvtier_protocol import codecs
from kvtier_protocol.codec_plan import CODEC_BITS, plan_codec, section_lengths
from kvtier_protocol.codecs import decode, default_quant, encode
from kvtier_protocol.errors import CodecError
from kvtier_protocol.quant import QuantParams

pytestmark = pytest.mark.skipif(not codecs.NATIVE, reason="kvtier_protocol._codecs is not built")

QUANTIZING = ("int8", "int4", "int2", "fp8_e4m3")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-identical, except that NaNs compare as "is NaN" (SPEC 5.4: their bits are unspecified)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(na, nb)
    ia = a.contiguous().view(torch.int32 if a.element_size() == 4 else torch.int16)
    ib = b.contiguous().view(torch.int32 if b.element_size() == 4 else torch.int16)
    assert torch.equal(ia[~na], ib[~nb])


def _check(x: torch.Tensor, codec: str, quant: QuantParams | None = None, *, mla: bool = False) -> None:
    """encode, encode_into and (integer codecs) the one-pass C loop against the torch path; decode
    of the reference bytes by both paths."""
    ref = encode(x, codec, quant, mla=mla, native=False)
    fast = encode(x, codec, quant, mla=mla, native=True)
    assert ref.quant == fast.quant
    assert [n for n, _ in ref.sections] == [n for n, _ in fast.sections]
    for (name, a), (_, b) in zip(ref.sections, fast.sections):
        assert torch.equal(a, b), f"{codec} {x.dtype} section {name} differs"
    want = b"".join(bytes(t.numpy()) for _, t in ref.sections)
    buf, lengths, used = codecs.encode_into(x, codec, quant, mla=mla, alloc=bytearray)
    assert bytes(buf) == want and used == ref.quant
    assert lengths == [(n, t.numel()) for n, t in ref.sections]
    if codec != "fp8_e4m3":  # the one-pass C loop itself (encode_into falls back to encode if it cannot settle)
        pl = plan_codec(codec, quant or default_quant(codec, mla=mla), tuple(x.shape), _name(x.dtype), mla)
        got = codecs._encode_int_into(pl, x.contiguous(), pl.quant, bytearray)
        assert got is not None and bytes(got[0]) == want and got[2] == ref.quant
    secs = {n: memoryview(bytes(t.numpy())) for n, t in ref.sections}
    kw = dict(codec=codec, quant=ref.quant, shape=tuple(x.shape), dtype=_name(x.dtype), mla=mla)
    _same_tensor(decode(secs, **kw, native=False), decode(secs, **kw, native=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", QUANTIZING)
def test_mha_defaults(codec: str, dtype: torch.dtype) -> None:
    for seed, (L, H, T, D) in enumerate([(2, 4, 64, 128), (3, 2, 16, 64), (1, 3, 37, 24)]):
        _check(synthetic_kv(L, H, T, D, dtype=dtype, seed=seed), codec)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ("int8", "int4", "int2"))
def test_mha_axes_and_ragged_groups(codec: str, dtype: torch.dtype) -> None:
    bits = CODEC_BITS[codec]
    x = synthetic_kv(2, 3, 37, 24, dtype=dtype, seed=7)
    for k_axis, v_axis, kg, vg in [("token", "channel", 8, 12), ("channel", "channel", 4, 0),
                                   ("token", "token", 0, 20), ("channel", "token", 64, 64)]:
        _check(x, codec, QuantParams(bits, k_axis, v_axis, kg, vg, "float16"))
        _check(x, codec, QuantParams(bits, k_axis, v_axis, kg, vg, "float32"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", QUANTIZING)
def test_mla(codec: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 19, 40, generator=gen) * 3).to(dtype)
    bits = CODEC_BITS[codec]
    sdt = "float32" if codec == "fp8_e4m3" else "float16"
    _check(x, codec, default_quant(codec, mla=True, rope_dims=8), mla=True)
    _check(x, codec, default_quant(codec, mla=True), mla=True)
    _check(x, codec, QuantParams(bits, "token", "token", 12, 12, sdt, 4), mla=True)
    if codec != "fp8_e4m3":
        _check(x, codec, QuantParams(bits, "channel", "token", 8, 8, sdt, 4), mla=True)


@pytest.mark.parametrize("codec", QUANTIZING)
def test_constant_groups_zeros_and_the_float32_fallback(codec: str) -> None:
    x = synthetic_kv(2, 2, 32, 16, dtype=torch.float32, seed=1)
    x[0, 1, 0, 3] = 5.0  # a constant V token (per-token groups: scale 0)
    x[1, 0, 1] = 0.0  # a whole K head of zeros (fp8 scale 0, int constant channels)
    _check(x, codec)
    _check(x.bfloat16(), codec)
    big = x * 1e6  # scales above float16's range: the whole block falls back to float32 scales
    _check(big, codec)
    if codec != "fp8_e4m3":
        assert encode(big, codec, native=True).quant.scale_dtype == "float32"
    tiny = x * 1e-9  # float16-subnormal scales: also the fall-back
    _check(tiny, codec)
    _check(x.half() * 1000, codec)  # float16 values near the top of the range


@pytest.mark.parametrize("codec", QUANTIZING)
@pytest.mark.parametrize("bad", (math.nan, math.inf, -math.inf))
def test_non_finite_input_is_refused_by_both(codec: str, bad: float) -> None:
    x = synthetic_kv(1, 2, 16, 16, dtype=torch.bfloat16, seed=2)
    x[0, 1, 1, 5, 7] = bad
    for native in (False, True):
        with pytest.raises(CodecError, match="NaN or Inf"):
            encode(x, codec, native=native)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", QUANTIZING)
def test_decoding_random_bytes(codec: str, dtype: torch.dtype) -> None:
    """Garbage sections (NaN and huge scales among them) decode alike on both paths, never to Inf."""
    gen = torch.Generator().manual_seed(11)
    for mla, shape in ((False, (2, 2, 3, 10, 24)), (True, (2, 9, 40))):
        quant = default_quant(codec, mla=mla, rope_dims=8 if mla else 0)
        if codec != "fp8_e4m3":
            quant = QuantParams(quant.bits, quant.k_axis, quant.v_axis, quant.k_group, quant.v_group,
                                "float32", quant.rope_dims)
        secs = {n: memoryview(bytes(torch.randint(0, 256, (ln,), dtype=torch.uint8, generator=gen).numpy()))
                for n, ln in section_lengths(codec, quant, shape, _name(dtype), mla)}
        kw = dict(codec=codec, quant=quant, shape=shape, dtype=_name(dtype), mla=mla)
        a, b = decode(secs, **kw, native=False), decode(secs, **kw, native=True)
        _same_tensor(a, b)
        assert not torch.isinf(b.float()).any()


def test_native_false_and_unsupported_inputs() -> None:
    x = synthetic_kv(1, 2, 16, 16, dtype=torch.bfloat16, seed=0)
    with pytest.raises(CodecError, match="native codec path"):
        encode(x.to(torch.float8_e4m3fn), "int8", native=True)
    # fp8 sources take the torch path by default, and still decode
    enc = encode(x.to(torch.float8_e4m3fn), "int8")
    secs = {n: memoryview(t.numpy()) for n, t in enc.sections}
    y = decode(secs, codec="int8", quant=enc.quant, shape=tuple(x.shape), dtype="float8_e4m3fn")
    assert y.dtype == torch.float8_e4m3fn


def _gen_blocks():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "protocol" / "vectors" / "gen_blocks.py"
    spec = importlib.util.spec_from_file_location("kvtier_vectors_gen_blocks_native", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


GEN = _gen_blocks()


@pytest.mark.parametrize("spec", [s for s in GEN.SPECS if s.codec != "raw"], ids=lambda s: s.name)
def test_every_quantized_golden_vector_source(spec) -> None:
    """The golden vectors' sources (every layout they come in, converted to canonical as
    encode_block does), with their parameters, through both paths; fp8 sources only have the
    torch path. (test_vectors_blocks.py checks the default path against the stored bytes.)"""
    from kvtier_protocol.layouts import get_layout, to_canonical

    lay = get_layout(spec.layout)
    x = to_canonical(GEN.source_tensor(spec), lay)
    quant = spec.quant
    if quant is None and lay.is_mla:
        quant = default_quant(spec.codec, mla=True)
    if x.dtype not in DTYPES:
        assert not codecs._use_native(None, x.device, x.dtype)
        return
    _check(x.contiguous(), spec.codec, quant, mla=lay.is_mla)
    _check(x, spec.codec, quant, mla=lay.is_mla)  # a strided view: the C loops read a contiguous copy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ("int8", "int4", "int2"))
def test_stored_scales_and_minima_round_alike(codec: str, dtype: torch.dtype) -> None:
    """The per-group parameters (C's int_params against the torch path): float16 minima that are
    subnormal or round up to the next binade, scales at every magnitude float16 holds, and minima
    just past +-65504, which send the block to float32 scales."""
    gen = torch.Generator().manual_seed(13)
    x = synthetic_kv(2, 2, 24, 32, dtype=torch.float32, seed=4)
    offsets = torch.exp2(torch.randint(-30, 15, (2, 1, 2, 1, 32), generator=gen).float())
    x = x * torch.exp2(torch.randint(-12, 12, (2, 2, 2, 1, 1), generator=gen).float()) * 1e-3 + offsets
    _check(x.to(dtype), codec)
    sub = (torch.rand(x.shape, generator=gen) + torch.rand(x.shape, generator=gen) * 2**-16).to(dtype)
    sub[:, :, :, 0] = 3 * 2**-20  # per-channel (K) and per-token (V) minima among float16's subnormals
    _check(sub, codec)
    assert encode(sub, codec, native=True).quant.scale_dtype == "float16"
    if dtype != torch.float16:
        past = x.clone()
        past[0, 0, 0, :, 0] = 65520.0 + torch.arange(24.0)  # a minimum float16 cannot hold
        _check(past.to(dtype), codec)
        assert encode(past.to(dtype), codec, native=True).quant.scale_dtype == "float32"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_a_range_overflowing_float32_is_refused_by_both(dtype: torch.dtype) -> None:
    x = torch.zeros(1, 2, 1, 2, 2)
    x[0, 0, 0, :, 0] = torch.tensor([-3e38, 3e38])
    for native in (False, True):
        with pytest.raises(CodecError, match="overflows float32"):
            encode(x.to(dtype), "int8", native=native)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ("int8", "int4", "int2"))
def test_one_pass_loop_on_random_geometries(codec: str, dtype: torch.dtype) -> None:
    """_codecs.encode_int (statistics, parameters and codes in one pass) against the torch path
    on random shapes, axes and group sizes (ragged ones included), MHA and MLA, values at many
    scales, and groups whose values sit exactly on the code grid's half steps (round-half-even)."""
    gen = torch.Generator().manual_seed(25 + CODEC_BITS[codec])
    per = 8 // CODEC_BITS[codec]
    for trial in range(12):
        L, T = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 41, (1,), generator=gen))
        D = per * int(torch.randint(1, 40, (1,), generator=gen))
        scale = float(torch.exp2(torch.randint(-20, 16, (1,), generator=gen)))
        if trial % 3 == 2:  # MLA, the last rope dims raw
            x = (torch.randn(L, T, D + 8, generator=gen) * scale).to(dtype)
            g = per * int(torch.randint(1, 12, (1,), generator=gen))
            _check(x, codec, QuantParams(CODEC_BITS[codec], "token", "token", g, g, "float16", 8), mla=True)
            continue
        H = int(torch.randint(1, 4, (1,), generator=gen))
        x = torch.randn(L, 2, H, T, D, generator=gen) * scale
        if trial % 3 == 1:  # half steps of a scale whose reciprocal is inexact: (k + 1/2) * 3 from 0 to 3 * qmax
            qmax = (1 << CODEC_BITS[codec]) - 1
            k = torch.randint(0, qmax, x.shape, generator=gen).float()
            x = (k + 0.5) * 3.0
            x[:, :, :, 0], x[:, :, :, -1] = 0.0, 3.0 * qmax  # every K channel and V token spans 0..3*qmax
            x[:, :, :, :, 0], x[:, :, :, :, -1] = 0.0, 3.0 * qmax
        axes = ("channel", "token")
        k_axis, v_axis = axes[int(torch.randint(0, 2, (1,), generator=gen))], axes[trial % 2]
        kg, vg = (int(torch.randint(0, 3, (1,), generator=gen)) * per * int(torch.randint(1, 6, (1,), generator=gen))
                  for _ in range(2))
        for sdt in ("float16", "float32"):
            _check(x.to(dtype), codec, QuantParams(CODEC_BITS[codec], k_axis, v_axis, kg, vg, sdt))


@pytest.mark.parametrize("codec", ("int8", "int4"))
def test_one_pass_loop_leaves_refused_blocks_to_the_reference_rules(codec: str) -> None:
    """NaN/Inf or a range overflowing float32: the one-pass loop settles nothing (None) and
    encode_into raises the reference path's error, whichever part (K or V) holds the value."""
    for bad, match in [(math.nan, "NaN or Inf"), (math.inf, "NaN or Inf"), (3e38, "overflows float32")]:
        for part in (0, 1):
            x = synthetic_kv(2, 2, 8, 16, dtype=torch.float32, seed=3)
            x[1, part, 1, 5, 7] = bad
            if bad == 3e38:  # -3e38 in the same K group (channel 7) and V group (token 5)
                x[1, part, 1, 6, 7] = x[1, part, 1, 5, 6] = -bad
            pl = plan_codec(codec, default_quant(codec), tuple(x.shape), "float32", False)
            assert codecs._encode_int_into(pl, x, pl.quant, bytearray) is None
            for native in (False, True):
                with pytest.raises(CodecError, match=match):
                    codecs.encode_into(x, codec, alloc=bytearray, native=native)
