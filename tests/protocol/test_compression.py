"""The lz4 stage of a block record (kvtier_protocol.compression, SPEC.md §4.8)."""

from __future__ import annotations

import dataclasses
import os
import struct

import lz4.block
import numpy as np
import pytest
import torch
import xxhash

from kvtier.bench.codecs import synthetic_kv
from kvtier_protocol import compression
from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.compression import FLAG_COMPRESSED, Compression, compress_sections, shuffle, unshuffle
from kvtier_protocol.errors import CodecError, HeaderError, LimitExceeded, UnsupportedVersion
from kvtier_protocol.header import PREAMBLE, PREAMBLE_LEN, decode_header, encode_header, split_record

NS = bytes(range(16))


def _record(x: torch.Tensor, codec: str = "raw", comp: str | None = "lz4", **kw) -> bytes:
    return encode_block(x, ns_id=NS, chain_hash=b"\x07" * 16, parent_hash=None, layout=kw.pop("layout", "canonical"),
                        codec=codec, compression=comp, **kw)


def _rewrite(record: bytes, **changes) -> bytes:
    """The record with header fields replaced (payload and its checksum recomputed from ``payload``)."""
    h, payload = split_record(record)
    payload = changes.pop("payload", bytes(payload))
    h = dataclasses.replace(h, payload_len=len(payload), checksum=xxhash.xxh3_64_intdigest(payload), **changes)
    return encode_header(h) + payload


@pytest.mark.parametrize("codec", ("raw", "int8", "int4", "int2", "fp8_e4m3"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_every_codec_decodes_to_the_same_tensor_with_and_without_lz4(codec: str, dtype: torch.dtype) -> None:
    x = synthetic_kv(2, 4, 64, 64, dtype=dtype, seed=3)
    plain, packed = _record(x, codec, None), _record(x, codec)
    hp, tp = decode_block(plain)
    hc, tc = decode_block(packed)
    assert torch.equal(tp.view(torch.uint8), tc.view(torch.uint8))
    assert hc.compression is not None and hp.compression is None
    assert packed[6] & FLAG_COMPRESSED and not plain[6] & FLAG_COMPRESSED
    # the header describes the stored bytes; compression the bytes before it, section by section
    assert [n for _, n in hc.compression.sections] == [s.length for s in hp.sections]
    assert hc.payload_len == sum(s.length for s in hc.sections) <= hp.payload_len
    assert (hc.codec, hc.quant, hc.shape, hc.dtype) == (hp.codec, hp.quant, hp.shape, hp.dtype)


def test_mla_and_other_layouts() -> None:
    x = torch.randn(3, 16, 96).bfloat16()
    for codec in ("raw", "int8", "fp8_e4m3"):
        rec = _record(x, codec, layout="mla-latent", mla_rope_dim=32)
        assert torch.equal(decode_block(rec)[1], decode_block(_record(x, codec, None, layout="mla-latent",
                                                                      mla_rope_dim=32))[1])
    y = synthetic_kv(2, 2, 16, 32).permute(0, 1, 3, 2, 4).contiguous()  # vllm-flash [L, 2, T, H, D]
    h, t = decode_block(_record(y, layout="vllm-flash"))
    assert h.layout == "vllm-flash" and torch.equal(t, y)


def test_raw_bf16_kv_compresses_and_random_bytes_are_stored_verbatim() -> None:
    h, _ = split_record(_record(synthetic_kv(2, 4, 64, 128)))
    assert h.compression.sections[0][0] == 2 and h.payload_len < 0.9 * h.decoded_len
    noise = torch.from_numpy(np.frombuffer(os.urandom(2 * (2 * 2 * 4 * 16 * 32)), np.int16).copy()).view(torch.bfloat16)
    noise = noise.reshape(2, 2, 4, 16, 32)
    noise[noise.isnan() | noise.isinf()] = 0
    rec = _record(noise)
    h, payload = split_record(rec)
    assert h.compression.sections == ((0, h.decoded_len),) and h.payload_len == h.decoded_len
    assert torch.equal(decode_block(rec)[1].view(torch.int16), noise.view(torch.int16))


@pytest.mark.parametrize("stride", (1, 2, 4, 8))
def test_shuffle_paths_agree_and_invert(stride: int) -> None:
    data = os.urandom(stride * 1000)
    shuffled = bytes(shuffle(data, stride))
    want = np.frombuffer(data, np.uint8).reshape(-1, stride).T.tobytes()
    assert shuffled == want  # byte k of every element, then byte k+1 (the C loop where built)
    back = bytearray(len(data))
    unshuffle(shuffled, stride, back)
    assert bytes(back) == data


def test_the_flag_and_the_key_must_agree() -> None:
    rec = _record(synthetic_kv(1, 2, 16, 32))
    hlen = struct.unpack_from("<I", rec, 8)[0]
    magic, version, flags, header_len, xxh = PREAMBLE.unpack_from(rec)
    no_flag = PREAMBLE.pack(magic, version, 0, header_len, xxh) + rec[PREAMBLE_LEN:]
    with pytest.raises(HeaderError, match="disagree"):
        decode_header(no_flag)
    with pytest.raises(UnsupportedVersion):  # a bit no reader knows yet
        decode_header(PREAMBLE.pack(magic, version, flags | 2, header_len, xxh) + rec[PREAMBLE_LEN:])
    assert len(rec) > PREAMBLE_LEN + hlen


def test_a_reader_that_predates_the_stage_refuses_the_record() -> None:
    """Such a reader refuses every flag bit (SPEC 4.1): it cannot take the LZ4 bytes for the tensor."""
    rec = _record(synthetic_kv(1, 2, 16, 32))
    flags = PREAMBLE.unpack_from(rec)[2]
    assert flags != 0  # what an older reader checks first: refused with unsupported_version


def test_header_rules() -> None:
    rec = _record(synthetic_kv(1, 2, 16, 32), "int8")
    h, _ = split_record(rec)
    with pytest.raises(HeaderError, match="sections"):
        dataclasses.replace(h, compression=Compression("lz4", h.compression.sections[:2]))
    n = h.sections[0].length
    with pytest.raises(HeaderError, match="verbatim"):
        dataclasses.replace(h, compression=Compression("lz4", ((0, n + 1), *h.compression.sections[1:])))
    for bad in (((3, 10),), ((65, 130),), ((-1, 4),), ((True, 4),)):
        with pytest.raises(HeaderError):
            Compression("lz4", bad)
    with pytest.raises(HeaderError):
        Compression.from_wire({"alg": "lz4", "sections": [[1, 2, 3]]})
    with pytest.raises(HeaderError):
        Compression.from_wire({"sections": []})
    # the raw rule is about the decompressed length
    raw, _ = split_record(_record(synthetic_kv(1, 2, 16, 32)))
    with pytest.raises(HeaderError, match="codec raw"):
        dataclasses.replace(raw, compression=Compression("lz4", ((2, raw.decoded_len - 2),)))


def test_decoding_refuses_bad_compressed_sections() -> None:
    x = synthetic_kv(2, 4, 64, 128)
    rec = _record(x)
    h, payload = split_record(rec)
    assert h.compression.sections[0][0] == 2  # compressed, not verbatim
    # an unknown algorithm: the header decodes (listable), decoding the tensor fails with codec
    with pytest.raises(CodecError, match="unknown compression"):
        decode_block(_rewrite(rec, compression=Compression("zstd", h.compression.sections)))
    # garbage with a valid checksum
    junk = os.urandom(h.payload_len)
    with pytest.raises(CodecError):
        decode_block(_rewrite(rec, payload=junk, sections=(dataclasses.replace(h.sections[0], length=len(junk)),)))
    # a valid LZ4 block of the wrong decompressed length
    short = lz4.block.compress(bytes(h.decoded_len - 2), store_size=False)
    with pytest.raises(CodecError):
        decode_block(_rewrite(rec, payload=short, sections=(dataclasses.replace(h.sections[0], length=len(short)),)))


def test_the_decompressed_size_is_bounded_before_decompressing() -> None:
    rec = _record(synthetic_kv(1, 2, 16, 32))
    h, _ = split_record(rec)
    with pytest.raises(LimitExceeded):
        decode_header(rec, max_payload_len=h.decoded_len - 1)


def test_unknown_compression_name_is_refused_when_encoding() -> None:
    with pytest.raises(CodecError):
        _record(synthetic_kv(1, 2, 16, 32), comp="zstd")


def test_headers_re_encode_byte_identically() -> None:
    rec = _record(synthetic_kv(1, 2, 16, 32), "int4")
    h, off = decode_header(rec)
    assert encode_header(h) == rec[:off]


def test_min_saving_stores_marginal_sections_verbatim() -> None:
    stored, c = compress_sections([bytes(1000), os.urandom(1000)], [1, 1])
    assert c.sections == ((1, 1000), (0, 1000)) and len(stored[0]) < 100
    stored, c = compress_sections([bytes(1000)], [1], min_saving=0.999)
    assert c.sections == ((0, 1000),)
    assert compression.ALGORITHMS == ("lz4",)


@pytest.mark.parametrize("stride", (2, 4))
def test_the_numpy_shuffle_of_installs_without_the_c_extension(stride: int, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(stride * 777)
    with_c = bytes(shuffle(data, stride))
    monkeypatch.setattr(compression, "_codecs", None)  # what an install without a C compiler runs
    assert bytes(shuffle(data, stride)) == with_c
    back = bytearray(len(data))
    unshuffle(with_c, stride, back)
    assert bytes(back) == data
