"""The rules SPEC.md settles beyond the golden vectors: which error a quant field gets, section
order, layouts of quantized records, saturation on decode, short hashes, text limits, defaults
on the wire. Each test names the SPEC section that states the rule."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import msgpack
import pytest
import torch
import xxhash

from kvtier_protocol import frames as fr
from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.codecs import decode, encode
from kvtier_protocol.errors import CodecError, HeaderError, LimitExceeded, NamespaceError
from kvtier_protocol.header import Section, decode_header, encode_header, split_record
from kvtier_protocol.namespace import Namespace
from kvtier_protocol.quant import QuantParams

NS = bytes(range(16))
HASH = hashlib.sha256(b"spec-rules").digest()


def _x(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n, dtype=torch.float32) * 0.37) % 7 - 3).reshape(shape).to(dtype)


def _record(x: torch.Tensor, codec: str, layout: str = "canonical", **kw) -> bytes:
    return encode_block(x, ns_id=NS, chain_hash=HASH, parent_hash=None, layout=layout, codec=codec, **kw)


def _rewrite(record: bytes, payload: bytes | None = None, **changes) -> bytes:
    """The record with header fields replaced (and, optionally, another payload)."""
    h, body = split_record(record)
    return encode_header(dataclasses.replace(h, **changes)) + (bytes(body) if payload is None else payload)


# --- §4.4 step 9 vs §5.10: which quant checks are bad_header, which are codec -----------------


@pytest.mark.parametrize("quant", [{"bits": 3}, {"bits": 4, "k_axis": "row"}, {"bits": 4, "k_group": (1 << 20) + 1},
                                   {"bits": 4, "scale_dtype": "float64"}, {"bits": 4, "rope_dims": -1},
                                   {"k_axis": "channel"}, {"bits": True}])
def test_quant_field_values_are_header_errors(quant: dict) -> None:
    with pytest.raises(HeaderError):
        QuantParams.from_wire(quant)


@pytest.mark.parametrize("change", [
    {"quant": None},  # a quantizing codec without quant
    {"quant": QuantParams(8, "channel", "token", 32, 32)},  # bits do not match int4
    {"quant": QuantParams(4, "channel", "token", 3, 32)},  # group not a multiple of 8/bits
    {"quant": QuantParams(4, "channel", "token", 32, 32, "float16", 2)},  # rope_dims in MHA
    {"codec": "int5"},  # unknown codec
])
def test_quant_rules_against_the_codec_are_codec_errors(change: dict) -> None:
    record = _record(_x((1, 2, 1, 4, 8)), "int4")
    bad = _rewrite(record, **change)
    decode_header(bad)  # the header is valid: it can be listed and inspected
    with pytest.raises(CodecError):
        decode_block(bad)


def test_fp8_quant_rules_are_codec_errors() -> None:
    record = _record(_x((1, 2, 1, 4, 8)), "fp8_e4m3")
    bad = _rewrite(record, quant=QuantParams(8, scale_dtype="float16"))
    with pytest.raises(CodecError):
        decode_block(bad)


def test_integer_source_dtype_is_a_codec_error() -> None:
    with pytest.raises(CodecError):
        _record(torch.zeros((1, 2, 1, 4, 8), dtype=torch.int8), "int8")


# --- §4.2: reader defaults of a short quant map do not depend on the attention kind -----------


def test_missing_quant_keys_take_fixed_defaults_even_for_mla() -> None:
    assert QuantParams.from_wire({"bits": 8}) == QuantParams(8, "channel", "token", 0, 0, "float16", 0)
    record = _record(_x((1, 4, 8)), "int8", layout="mla-latent")
    assert decode_header(record)[0].quant.k_axis == "token"  # what the encoder wrote: all seven keys
    short = _rewrite(record, quant=QuantParams.from_wire({"bits": 8}))
    h, _ = decode_header(short)
    assert (h.quant.k_axis, h.quant.k_group) == ("channel", 0)


# --- §5.1 / §6.3: a quantized record is canonical or mla-latent, else codec -------------------


@pytest.mark.parametrize("layout, shape", [("vllm-flash", (2, 2, 8, 2, 8)),  # same rank, kv at axis 1
                                           ("sglang-page-first-direct", (2, 2, 8, 2, 8))])
def test_quantized_record_in_another_layout_is_a_codec_error(layout: str, shape: tuple[int, ...]) -> None:
    record = _record(_x((2, 2, 2, 8, 8)), "int4")
    bad = _rewrite(record, layout=layout, shape=shape, num_tokens=8)
    decode_header(bad)
    with pytest.raises(CodecError):
        decode_block(bad)


def test_quantized_mla_record_in_page_first_is_a_codec_error() -> None:
    record = _record(_x((2, 4, 16)), "int8", layout="mla-latent")
    bad = _rewrite(record, layout="sglang-mla-page-first", shape=(4, 2, 16))
    with pytest.raises(CodecError):
        decode_block(bad)


# --- §5.1: sections are found by name; a permuted order is accepted ---------------------------


def test_permuted_section_order_decodes_the_same() -> None:
    record = _record(_x((1, 2, 2, 8, 8)), "int4")
    h, body = split_record(record)
    parts = {s.name: bytes(body[s.offset:s.offset + s.length]) for s in h.sections}
    order, sections, offset = ("mins", "payload", "scales"), [], 0
    for name in order:
        sections.append(Section(name, offset, len(parts[name])))
        offset += len(parts[name])
    payload = b"".join(parts[n] for n in order)
    permuted = _rewrite(record, payload=payload, sections=tuple(sections),
                        checksum=xxhash.xxh3_64_intdigest(payload))
    assert torch.equal(decode_block(permuted)[1], decode_block(record)[1])


# --- §5.4: decoding saturates to the dtype's finite range; NaN scales give NaN, never an error --


def test_a_finite_float16_block_never_decodes_to_inf() -> None:
    x = torch.zeros((1, 2, 1, 2, 1), dtype=torch.float16)
    x[0, 0, 0, 0, 0], x[0, 0, 0, 1, 0] = -65504, 65504  # int8 scale 513.76 rounds up to 514
    y = decode_block(_record(x, "int8"))[1]
    assert torch.isfinite(y).all()
    assert y.flatten().tolist()[:2] == [-65504.0, 65504.0]


@pytest.mark.parametrize("scale_bits, want", [(0x7E00, "nan"), (0x7C00, "sat")])  # float16 NaN, +Inf
def test_non_finite_scales_decode_without_error(scale_bits: int, want: str) -> None:
    x = _x((1, 2, 1, 4, 2), torch.float16)
    enc = encode(x, "int8")
    sections = {n: bytearray(t.numpy().tobytes()) for n, t in enc.sections}
    sections["scales"][0:2] = struct.pack("<H", scale_bits)  # K, channel 0
    sections["payload"][2] = 1  # K token 1 channel 0: code 1 (token 0's code 0 times Inf is NaN)
    y = decode(sections, codec="int8", quant=enc.quant, shape=x.shape, dtype="float16")
    k0 = y[0, 0, 0, 1, 0].item()
    if want == "nan":
        assert k0 != k0
    else:  # Inf * 1 + min saturates to the largest float16
        assert k0 == 65504.0
        assert y[0, 0, 0, 0, 0].isnan()


# --- §3 / §4.2: hashes of 8..64 bytes are opaque key bytes -------------------------------------


def _remap(record: bytes, **values) -> bytes:
    """The record with header map values replaced at the msgpack level (no header validation)."""
    _, body = split_record(record)
    (header_len,) = struct.unpack_from("<I", record, 8)
    m = msgpack.unpackb(record[20:20 + header_len], raw=False)
    m.update(values)
    raw = msgpack.packb(m, use_bin_type=True)
    return b"KVT1" + struct.pack("<HHIQ", 1, 0, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw + bytes(body)


def test_short_hashes_are_accepted_and_kept_whole() -> None:
    record = _record(_x((1, 2, 1, 2, 2)), "raw")
    for n in (8, 16, 64):
        h, _ = decode_header(_remap(record, hash=bytes(range(n)), parent=bytes(n)))
        assert h.chain_hash == bytes(range(n)) and len(h.ns_id + h.chain_hash) == 16 + n
    for n in (7, 65):
        with pytest.raises(HeaderError):
            decode_header(_remap(record, hash=bytes(n)))
    lookup = {"op": "lookup", "id": 1, "ns_id": NS, "hashes": [bytes(8), HASH, bytes(64)]}
    assert [len(h) for h in fr.validate_request(lookup).hashes] == [8, 32, 64]


# --- §7.2: text limits count Unicode code points -----------------------------------------------


def test_text_limit_counts_code_points_not_bytes() -> None:
    ok = {"op": "hello", "id": 1, "version": 1, "client": "€" * fr.MAX_TEXT_LEN}  # 3072 UTF-8 bytes
    assert fr.validate_request(ok).client == "€" * fr.MAX_TEXT_LEN
    with pytest.raises(LimitExceeded):
        fr.validate_request({**ok, "client": "a" * (fr.MAX_TEXT_LEN + 1)})
    err = fr.error_response(3, CodecError("é" * 2000))
    assert err["err"]["msg"] == "é" * fr.MAX_TEXT_LEN


# --- §7.2: optional keys with a value default are always emitted ------------------------------


def test_value_defaults_are_emitted_and_nil_defaults_left_out() -> None:
    header = fr.ReserveRequest(id=1, ns_id=NS, hashes=(HASH,), sizes=(8,)).to_header()
    assert header["lease_ms"] == 30_000 and header["priority"] == 0
    hello = fr.HelloRequest(id=1, version=1, client="c").to_header()
    assert "tenant" not in hello and "token" not in hello
    # A peer that leaves them out is read the same, but its frame is not the canonical encoding.
    sparse = {"op": "reserve", "id": 1, "ns_id": NS, "hashes": [HASH], "sizes": [8]}
    message = fr.validate_request(sparse)
    assert message.to_header() == header != sparse


# --- §2.1 / §6.2: head_dim_v != head_dim namespaces have no block record -----------------------


def test_a_block_of_a_head_dim_v_namespace_is_refused_with_namespace() -> None:
    from kvtier.daemon.store.validation import check_geometry  # the receiver's check of §2.1

    ns = Namespace("tiny", "r1", "mha", 1, 1, 8, head_dim_v=4, kv_dtype="bfloat16", block_tokens=2,
                   hash_tokens=2)
    h, _ = decode_header(_record(_x((1, 2, 1, 2, 8)), "raw"))
    with pytest.raises(NamespaceError):
        check_geometry(h, ns)
