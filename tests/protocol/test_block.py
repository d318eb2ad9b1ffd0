"""Tests of kvtier_protocol.block: whole records <-> tensors, across dtypes, layouts and codecs."""

from __future__ import annotations

import math
import random
import tracemalloc

import msgpack
import pytest
import torch
import xxhash

from kvtier_protocol.block import decode_block, dtype_name, encode_block, encode_block_into, torch_dtype
from kvtier_protocol.dtypes import DTYPE_SIZES
from kvtier_protocol.errors import (ChecksumMismatch, CodecError, HeaderError, KVTierError,
                                    LayoutError, LimitExceeded)
from kvtier_protocol.header import PREAMBLE, PREAMBLE_LEN, decode_header, split_record
from kvtier_protocol.layouts import LAYOUTS, Geometry, convert, from_canonical, get_layout
from kvtier_protocol.quant import QuantParams

NS = bytes(range(16))
HASH = bytes(range(100, 132))
PARENT = bytes(range(50, 82))
MHA = Geometry(num_layers=2, num_tokens=32, num_heads=2, head_dim=64)
MLA = Geometry(num_layers=2, num_tokens=8, latent_dim=160)
MHA_NAMES = sorted(n for n, lay in LAYOUTS.items() if not lay.is_mla)
MLA_NAMES = sorted(n for n, lay in LAYOUTS.items() if lay.is_mla)
QUANT_TOLERANCE = {"int8": 0.02, "int4": 0.3, "int2": 1.5, "fp8_e4m3": 0.3}  # max abs error, |x| <= 4


def block(layout: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = MLA if get_layout(layout).is_mla else MHA
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(get_layout(get_layout(layout).canonical_name).shape_for(g), generator=gen) * 8 - 4
    return from_canonical(x.to(dtype), layout)


def encode(x: torch.Tensor, layout: str, **kw) -> bytes:
    return encode_block(x, ns_id=NS, chain_hash=HASH, parent_hash=PARENT, layout=layout, **kw)


def test_dtype_names_map_to_torch() -> None:
    for name in DTYPE_SIZES:
        assert dtype_name(torch_dtype(name)) == name
        assert torch_dtype(name).itemsize == DTYPE_SIZES[name]
    with pytest.raises(CodecError):
        dtype_name(torch.float64)
    with pytest.raises(CodecError):
        torch_dtype("float64")


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_raw_round_trip_every_dtype(dtype: str) -> None:
    bits = torch.randint(0, 256, (2, 2, 2, 4, 8 * 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    x = bits.view(torch_dtype(dtype)).reshape(2, 2, 2, 4, -1)
    rec = encode(x, "canonical")
    h, y = decode_block(rec)
    assert (h.dtype, h.shape, h.codec, h.layout, h.num_tokens) == (dtype, tuple(x.shape), "raw", "canonical", 4)
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))  # bitwise, NaN payloads included
    # Raw payload is exactly the tensor's bytes.
    _, payload = split_record(rec)
    assert bytes(payload) == x.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("src", MHA_NAMES + MLA_NAMES)
def test_raw_keeps_the_given_layout_and_converts_on_decode(src: str) -> None:
    x = block(src)
    rec = encode(x, src)
    h, y = decode_block(rec)
    assert h.layout == src and torch.equal(y, x)
    names = MLA_NAMES if get_layout(src).is_mla else MHA_NAMES
    for dst in names:
        _, z = decode_block(rec, layout=dst)
        assert torch.equal(z, convert(x, src, dst))


@pytest.mark.parametrize("codec", sorted(QUANT_TOLERANCE))
@pytest.mark.parametrize("src", ["canonical", "vllm-nhc", "vllm-flash", "sglang-page-first"])
def test_quantized_codecs_store_canonical_and_decode_to_any_layout(codec: str, src: str) -> None:
    x = block(src)
    rec = encode(x, src, codec=codec)
    h, canon = decode_block(rec)
    assert h.layout == "canonical" and h.codec == codec and h.quant is not None
    assert h.shape == get_layout("canonical").shape_for(MHA) and h.dtype == "bfloat16"
    assert [s.name for s in h.sections][:2] == ["payload", "scales"]
    assert len(rec) < x.numel() * 2  # smaller than raw
    _, back = decode_block(rec, layout=src)
    assert back.shape == x.shape and torch.equal(back, convert(canon, "canonical", src))
    assert (back.float() - x.float()).abs().max().item() <= QUANT_TOLERANCE[codec]
    # The block's place in the layout does not change what is stored.
    assert rec == encode(convert(x, src, "canonical"), "canonical", codec=codec)


@pytest.mark.parametrize("codec,quant", [
    ("int8", None), ("int4", None), ("fp8_e4m3", None),
    ("int8", QuantParams(8, "token", "token", 128, 128, "float16", 32)),
])
@pytest.mark.parametrize("src", MLA_NAMES)
def test_mla_codecs(codec: str, quant: QuantParams | None, src: str) -> None:
    x = block(src)
    rec = encode(x, src, codec=codec, quant=quant)
    h, canon = decode_block(rec)
    assert h.layout == "mla-latent" and h.shape == (2, 8, 160)
    _, back = decode_block(rec, layout=src)
    assert (back.float() - x.float()).abs().max().item() <= QUANT_TOLERANCE[codec]
    if quant is not None and quant.rope_dims:
        assert torch.equal(canon[..., -32:], convert(x, src, "mla-latent")[..., -32:])  # RoPE dims raw
    with pytest.raises(LayoutError):
        decode_block(rec, layout="canonical")


def test_encode_argument_errors() -> None:
    x = block("canonical")
    with pytest.raises(LayoutError):
        encode(x, "vllm-nhc")
    with pytest.raises(LayoutError):
        encode(x, "nope")
    with pytest.raises(LayoutError):
        encode(x, "canonical", num_tokens=16)
    assert decode_header(encode(x, "canonical", num_tokens=32))[0].num_tokens == 32
    with pytest.raises(CodecError):
        encode(x.double(), "canonical")
    with pytest.raises(CodecError):
        encode(x, "canonical", quant=QuantParams(8))
    with pytest.raises(CodecError):
        encode(x, "canonical", codec="zstd")
    with pytest.raises(CodecError):
        encode(torch.full_like(x, float("nan")), "canonical", codec="int8")
    with pytest.raises(HeaderError):
        encode_block(x, ns_id=b"short", chain_hash=HASH, parent_hash=None, layout="canonical")


def test_optional_fields_and_strided_input() -> None:
    cache = torch.zeros(2, 5, 32, 2, 128, dtype=torch.bfloat16)  # vLLM LBNHC, 5 blocks
    cache[:, 3] = block("vllm-nhc")
    view = cache[:, 3]
    assert not view.is_contiguous() or view.storage_offset() != 0
    rec = encode(view, "vllm-nhc", ns_fields={"model": "m"}, created_ms=123)
    h, y = decode_block(rec)
    assert h.ns_fields == {"model": "m"} and h.created_ms == 123 and h.parent_hash == PARENT
    assert torch.equal(y, view)
    # The decoded tensor owns its memory: it does not alias the record buffer.
    buf = bytearray(rec)
    _, z = decode_block(buf)
    buf[-1] ^= 0xFF
    assert torch.equal(z, view)


def test_corruption_is_detected() -> None:
    rec = encode(block("canonical"), "canonical", codec="int4")
    h, _ = decode_block(rec)
    payload_at = len(rec) - h.payload_len
    for pos in (payload_at, payload_at + 1000, len(rec) - 1):
        bad = bytearray(rec)
        bad[pos] ^= 0x01
        with pytest.raises(ChecksumMismatch):
            decode_block(bytes(bad))
    for pos in (0, 5, 8, 12, PREAMBLE_LEN, PREAMBLE_LEN + 40, payload_at - 1):
        bad = bytearray(rec)
        bad[pos] ^= 0x01
        with pytest.raises(KVTierError):
            decode_block(bytes(bad))
    # verify=False skips the payload checksum (for bytes verified just before).
    raw = bytearray(encode(block("canonical"), "canonical"))
    raw[-2] ^= 0x40
    decode_block(bytes(raw), verify=False)
    with pytest.raises(ChecksumMismatch):
        decode_block(bytes(raw))


def _fixed(body: bytes) -> bytes:
    return PREAMBLE.pack(b"KVT1", 1, 0, len(body), xxhash.xxh3_64_intdigest(body)) + body


def test_huge_declared_payload_is_refused_before_allocation() -> None:
    rec = encode(block("canonical"), "canonical")
    h, off = decode_header(rec)
    m = msgpack.unpackb(rec[PREAMBLE_LEN:off], raw=False)
    shape = (1 << 29, 2, 1 << 29, 1, 4)
    n = math.prod(shape) * 2
    m.update(shape=list(shape), tokens=1, plen=n, sections=[["payload", 0, n]])
    bad = _fixed(msgpack.packb(m, use_bin_type=True)) + rec[off:]
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceeded):
            decode_block(bad)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 1 << 62 and peak < 1 << 20
    with pytest.raises(LimitExceeded):
        decode_block(rec, max_payload_len=h.payload_len - 1)


def test_fuzz_decode_block_raises_only_typed_errors() -> None:
    rng = random.Random(7)
    records = [encode(block("canonical"), "canonical", codec=c) for c in ("raw", "int4", "fp8_e4m3")]
    records.append(encode(block("mla-latent"), "mla-latent", codec="int8"))
    maps = []
    for rec in records:
        _, off = decode_header(rec)
        maps.append((msgpack.unpackb(rec[PREAMBLE_LEN:off], raw=False), rec[off:]))
    odd = [None, 0, 1, -1, 7, 1 << 40, "raw", "int4", "int2", "fp8_e4m3", "mla-latent", "vllm-nhc",
           "uint8", "float32", [2, 2, 2, 32, 64], [2, 8, 160], [1, 2, 1, 1, 1], {"bits": 4},
           {"bits": 8, "k_axis": "token"}, [["payload", 0, 16]], b"", "", 2.5]
    outcomes = {"ok": 0, "error": 0}
    for i in range(10_000):
        m, payload = maps[i % len(maps)]
        kind = i % 3
        if kind == 0:  # header fields changed behind a valid header checksum; payload intact
            m = dict(m)
            for _ in range(rng.randrange(1, 3)):
                m[rng.choice(list(m))] = rng.choice(odd)
            case = _fixed(msgpack.packb(m, use_bin_type=True)) + payload
        elif kind == 1:  # bit flips anywhere, or truncation
            case = bytearray(records[i % len(records)])
            case[rng.randrange(len(case))] ^= 1 << rng.randrange(8)
            case = bytes(case[: rng.randrange(len(case))] if rng.random() < 0.3 else case)
        else:  # random bytes behind a magic
            case = b"KVT1" + rng.randbytes(rng.randrange(0, 48))
        try:
            decode_block(case, verify=rng.random() < 0.5)
        except KVTierError:
            outcomes["error"] += 1
        else:
            outcomes["ok"] += 1
    assert outcomes["error"] > 8_000


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", ["raw", "int8", "int4", "fp8_e4m3"])
def test_cuda_round_trip_matches_cpu(codec: str) -> None:
    x = block("vllm-nhc")
    rec_cpu = encode(x, "vllm-nhc", codec=codec)
    assert encode(x.cuda(), "vllm-nhc", codec=codec) == rec_cpu
    _, on_gpu = decode_block(rec_cpu, layout="vllm-hnc", device="cuda")
    _, on_cpu = decode_block(rec_cpu, layout="vllm-hnc")
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)


SPEC_EXAMPLE = (  # SPEC.md §4.8: a float16 block of 1 layer, 1 head, 2 tokens, head_dim 2
    "4b56543101000000b3000000963c64a8449b46168da26e73c410000102030405"
    "060708090a0b0c0d0e0fa468617368c4109414886b1ebf025db067a4cbd13a09"
    "03a6706172656e74c0a6746f6b656e7302a66c61796f7574a963616e6f6e6963"
    "616ca57368617065950102010202a56474797065a7666c6f61743136a5636f64"
    "6563a3726177a873656374696f6e739193a77061796c6f61640010a4706c656e"
    "10a86373756d5f616c67a7787868332d3634a46373756dcfc92b15431b3f3665"
    "a57175616e74c0003c0040004200440045004600470048"
)


def test_spec_worked_example() -> None:
    x = torch.arange(1, 9, dtype=torch.float16).reshape(1, 2, 1, 2, 2)
    chain = bytes.fromhex("9414886b1ebf025db067a4cbd13a0903")  # sha256(b"chain")[:16]
    rec = encode_block(x, ns_id=bytes(range(16)), chain_hash=chain, parent_hash=None, layout="canonical")
    assert rec.hex() == SPEC_EXAMPLE
    h, y = decode_block(bytes.fromhex(SPEC_EXAMPLE))
    assert h.checksum == 0xC92B15431B3F3665 and torch.equal(y, x)
    quant = QuantParams(4, "channel", "token", 32, 32, "float16", 0)
    assert msgpack.packb(quant.to_wire()).hex() == (
        "87a462697473 04a66b5f61786973a76368616e6e656ca6765f61786973a5746f6b656e"
        "a76b5f67726f757020a7765f67726f757020ab7363616c655f6474797065a7666c6f61743136"
        "a9726f70655f64696d7300").replace(" ", "")


@pytest.mark.parametrize("compression", [None, "lz4"])
@pytest.mark.parametrize("codec", ["raw", "int8", "int4", "int2", "fp8_e4m3"])
def test_encode_block_into_writes_encode_blocks_record(codec: str, compression: str | None) -> None:
    """header + payload of encode_block_into is encode_block's record byte for byte (MHA and MLA
    with rope dims, every source dtype, the float32-scale fall-back), the payload is the last
    buffer alloc handed out, and the checksum is that of the buffer."""
    cases = [("canonical", torch.bfloat16, {}), ("canonical", torch.float16, {}), ("canonical", torch.float32, {})]
    cases.append((MLA_NAMES[0], torch.bfloat16, {"mla_rope_dim": 32} if codec not in ("raw", "fp8_e4m3") else {}))
    for layout, dtype, kw in cases:
        x = block(layout, dtype, seed=3)
        fallback = codec.startswith("int") and dtype != torch.float16 and not get_layout(layout).is_mla
        if fallback:
            x = x.clone()
            x.view(-1)[5] = -70000.0  # a minimum float16 cannot hold: float32 scales
        want = encode(x, layout, codec=codec, compression=compression, created_ms=5, **kw)
        handed: list[memoryview] = []

        def alloc(n: int) -> memoryview:
            handed.append(memoryview(bytearray(n)))
            return handed[-1]

        header, payload, checksum = encode_block_into(x, alloc=alloc, ns_id=NS, chain_hash=HASH, parent_hash=PARENT,
                                                      layout=layout, codec=codec, compression=compression,
                                                      created_ms=5, **kw)
        assert header + bytes(payload) == want
        assert payload is handed[-1] and checksum == xxhash.xxh3_64_intdigest(payload)
        assert decode_header(header)[0].checksum == checksum
        if fallback:
            assert decode_header(header)[0].quant.scale_dtype == "float32"
            assert len(handed) == (2 if compression is None else 1)  # the one-pass loop started over
