"""Fuzzing of block records: any bytes, any header map behind a valid preamble and checksum, and
every single-byte change of a golden record. Only typed errors come out, and no changed record
ever decodes into a tensor (a flipped byte is a miss, never wrong KV)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier_protocol import header as hd
from kvtier_protocol.block import decode_block
from kvtier_protocol.errors import KVTierError

from tests.protocol.fuzzkit import FUZZ, msgpack_values

VECTORS = sorted((Path(__file__).resolve().parents[2] / "protocol" / "vectors" / "blocks").glob("*.bin"))
SEEDS = [p.read_bytes() for p in VECTORS]
LIMIT = 4 << 20  # decoded tensors in these tests stay small


def split(seed: bytes) -> tuple[dict, bytes]:
    hlen = int.from_bytes(seed[8:12], "little")
    return msgpack.unpackb(seed[20:20 + hlen], raw=False), seed[20 + hlen:]


def record(m: object, payload: bytes) -> bytes:
    """A record with a valid preamble and header checksum around any map."""
    body = msgpack.packb(m, use_bin_type=True)
    return hd.PREAMBLE.pack(hd.MAGIC, 1, 0, len(body), xxhash.xxh3_64_intdigest(body)) + body + payload


def decode_everything(buf: bytes, layout: str | None = None) -> None:
    for call in (lambda: hd.decode_header(buf), lambda: hd.split_record(buf),
                 lambda: decode_block(buf, layout=layout, max_payload_len=LIMIT)):
        try:
            call()
        except KVTierError:
            pass


def test_golden_records_are_seeds() -> None:
    assert len(SEEDS) >= 10


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    decode_everything(data)
    decode_everything(hd.MAGIC + b"\x01\x00\x00\x00" + data)


@FUZZ
@given(st.sampled_from(SEEDS), st.sampled_from(["ns", "hash", "parent", "tokens", "layout", "shape", "dtype",
                                                 "codec", "sections", "plen", "csum_alg", "csum", "quant",
                                                 "ns_fields", "created", "future"]),
       msgpack_values, st.booleans(), st.sampled_from([None, "canonical", "vllm-nhc", "mla-latent"]))
def test_one_header_key_replaced(seed: bytes, key: str, value: object, fix_csum: bool, layout: str | None) -> None:
    """Any value for any key, the framing and (often) the payload checksum kept valid, so the
    value reaches the validators and the codecs."""
    m, payload = split(seed)
    m[key] = value
    if fix_csum and key not in ("plen", "csum"):
        m["plen"], m["csum"] = len(payload), xxhash.xxh3_64_intdigest(payload)
    decode_everything(record(m, payload), layout)


@FUZZ
@given(st.sampled_from(SEEDS), st.sampled_from(["shape", "sections", "quant"]), st.data())
def test_geometry_mutations_with_valid_checksums(seed: bytes, key: str, data: st.DataObject) -> None:
    """Shapes, sections and quant parameters changed within plausible ranges: the codec path
    must refuse what does not fit, by length checks, before touching the payload."""
    m, payload = split(seed)
    if key == "shape":
        m["shape"] = [data.draw(st.integers(0, 70)) for _ in m["shape"]]
        m["tokens"] = data.draw(st.sampled_from([m["tokens"], *m["shape"]]))
    elif key == "sections":
        m["sections"] = [[s[0], s[1], data.draw(st.integers(0, 2 * s[2] + 1))] for s in m["sections"]]
    elif isinstance(m.get("quant"), dict):
        q = m["quant"]
        q[data.draw(st.sampled_from(sorted(q)))] = data.draw(st.one_of(st.integers(-3, 300), st.text(max_size=8)))
    decode_everything(record(m, payload))


@pytest.mark.parametrize("seed", SEEDS[:6], ids=[p.stem for p in VECTORS[:6]])
def test_every_byte_change_is_detected(seed: bytes) -> None:
    """Each byte of a record XOR 0x01 (and a sample set to 0xFF): decode_block always raises."""
    positions = range(0, len(seed), max(1, len(seed) // 400))
    for pos in (*range(min(len(seed), 300)), *positions):
        for new in (seed[pos] ^ 0x01, 0xFF if seed[pos] != 0xFF else 0):
            buf = bytearray(seed)
            buf[pos] = new
            with pytest.raises(KVTierError):
                decode_block(bytes(buf))


def test_truncations_are_typed() -> None:
    for seed in SEEDS:
        for cut in range(0, len(seed), max(1, len(seed) // 64)):
            with pytest.raises(KVTierError):
                decode_block(seed[:cut])
