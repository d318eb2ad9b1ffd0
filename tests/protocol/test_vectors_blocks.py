"""Golden block records (protocol/vectors/blocks/): decode, compare with JSON, re-encode exactly."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.codec_plan import CODECS
from kvtier_protocol.dtypes import DTYPE_SIZES
from kvtier_protocol.header import decode_header, encode_header
from kvtier_protocol.layouts import LAYOUTS, convert, get_layout

VECTORS = Path(__file__).resolve().parents[2] / "protocol" / "vectors"
NAMES = sorted(p.stem for p in (VECTORS / "blocks").glob("*.json"))


def _gen():
    spec = importlib.util.spec_from_file_location("kvtier_vectors_gen_blocks", VECTORS / "gen_blocks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


GEN = _gen()


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def test_the_corpus_is_complete() -> None:
    assert NAMES == sorted(s.name for s in GEN.SPECS)
    descs = [json.loads((VECTORS / "blocks" / f"{n}.json").read_text()) for n in NAMES]
    assert {d["params"]["codec"] for d in descs} == set(CODECS)
    # Every layout and every dtype of SPEC §6 is stored raw by some vector ...
    raw = [d["params"] for d in descs if d["params"]["codec"] == "raw"]
    assert {p["layout"] for p in raw} == set(LAYOUTS)
    assert {p["dtype"] for p in raw} == set(DTYPE_SIZES)
    # ... and the quantizing codecs see float32, 16-bit and fp8 sources, and the float32-scale
    # fall-back of §5.4 (asked for float16 by default, stored with float32).
    quantized = [d for d in descs if d["params"]["codec"] != "raw"]
    assert {d["params"]["dtype"] for d in quantized} >= {"float32", "float16", "bfloat16", "float8_e4m3fn"}
    assert any(d["params"]["quant"] is None and d["header"]["quant"]["scale_dtype"] == "float32"
               and d["params"]["codec"] != "fp8_e4m3" for d in quantized)


def _independent_source(params: dict) -> torch.Tensor:
    """SPEC §10's source formula, rebuilt from the JSON alone with numpy (float64 -> float32), then
    one cast to the dtype; in the canonical layout."""
    shape = get_layout(get_layout(params["layout"]).canonical_name).shape_for(
        get_layout(params["layout"]).geometry_of(tuple(params["shape"])))
    i = np.arange(int(np.prod(shape)), dtype=np.uint64)
    u = (i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(1 << 32)
    if params["dtype"] in ("int8", "uint8"):
        return torch.from_numpy((u & np.uint64(0xFF)).astype(np.uint8)).view(
            getattr(torch, params["dtype"])).reshape(shape)
    x64 = u.astype(np.float64) / 2.0**32 * 8.0 - 4.0
    x32 = x64.astype(np.float32) * np.float32(2.0 ** params["source_scale_exp"])
    return torch.from_numpy(x32).to(getattr(torch, params["dtype"])).reshape(shape)


@pytest.mark.parametrize("name", NAMES)
def test_source_formula_is_reproducible_from_the_json(name: str) -> None:
    params = json.loads((VECTORS / "blocks" / f"{name}.json").read_text())["params"]
    source = convert(_independent_source(params), get_layout(params["layout"]).canonical_name,
                     params["layout"])
    assert _sha(source) == params["source_sha256"]


def test_source_formula_rounds_through_float32() -> None:
    # The precision is part of the formula: one float16 vector differs when float64 is rounded
    # straight to float16 (double rounding), so SPEC §10 names float64 -> float32 -> dtype.
    params = json.loads((VECTORS / "blocks" / "int4-f16-canonical.json").read_text())["params"]
    i = np.arange(int(np.prod(params["shape"])), dtype=np.uint64)
    u = (i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(1 << 32)
    direct = torch.from_numpy((u.astype(np.float64) / 2.0**32 * 8.0 - 4.0).astype(np.float16))
    assert _sha(direct) != params["source_sha256"]
    assert _sha(_independent_source(params).reshape(-1)) == params["source_sha256"]


@pytest.mark.parametrize("name", NAMES)
def test_vector_decodes_to_its_description(name: str) -> None:
    record = (VECTORS / "blocks" / f"{name}.bin").read_bytes()
    desc = json.loads((VECTORS / "blocks" / f"{name}.json").read_text())
    want = desc["header"]
    assert len(record) == desc["record"]["length"]
    assert hashlib.sha256(record).hexdigest() == desc["record"]["sha256"]
    h, offset = decode_header(record)
    assert offset == want["payload_offset"] == want["header_len"] + 20
    assert record[:offset].hex() == desc["record"]["header_hex"]
    assert (h.layout, list(h.shape), h.dtype, h.codec, h.num_tokens) == (
        want["layout"], want["shape"], want["dtype"], want["codec"], want["num_tokens"])
    assert [[s.name, s.offset, s.length] for s in h.sections] == want["sections"]
    assert (h.payload_len, h.checksum_alg, f"{h.checksum:016x}") == (
        want["payload_len"], want["checksum_alg"], want["checksum"])
    assert (h.quant.to_wire() if h.quant else None) == want["quant"]
    assert (h.compression.to_wire() if h.compression else None) == want.get("compression")
    assert bool(record[6] & 1) == (h.compression is not None)  # preamble flag bit 0 (SPEC 4.8)
    params = desc["params"]
    assert (h.ns_id.hex(), h.chain_hash.hex(), h.created_ms) == (
        params["ns_id"], params["chain_hash"], params["created_ms"])
    assert (h.parent_hash.hex() if h.parent_hash else None) == params["parent_hash"]
    assert [list(kv) for kv in h.extra] == params["extra"]
    # The header re-encodes byte-identically, unknown keys included.
    assert encode_header(h) == record[:offset]
    _, tensor = decode_block(record)
    assert _sha(tensor) == desc["decoded"]["sha256"]
    as_source = convert(tensor, h.layout, params["layout"])
    assert list(as_source.shape) == params["shape"]
    assert _sha(as_source) == desc["decoded"]["sha256_in_source_layout"]
    _, direct = decode_block(record, layout=params["layout"])
    assert torch.equal(direct, as_source)


@pytest.mark.parametrize("name", NAMES)
def test_vector_re_encodes_byte_identically(name: str) -> None:
    spec = next(s for s in GEN.SPECS if s.name == name)
    record = (VECTORS / "blocks" / f"{name}.bin").read_bytes()
    desc = json.loads((VECTORS / "blocks" / f"{name}.json").read_text())
    source = GEN.source_tensor(spec)
    assert _sha(source) == desc["params"]["source_sha256"]
    _same_record(GEN.encode_spec(spec), record, spec.compression)
    assert GEN.describe(spec, record) == desc
    if spec.codec == "raw" and not spec.extra:
        # A raw record is lossless: the decoded tensor re-encodes to the same record.
        h, tensor = decode_block(record)
        again = encode_block(tensor, ns_id=h.ns_id, chain_hash=h.chain_hash, parent_hash=h.parent_hash,
                             layout=h.layout, created_ms=h.created_ms,
                             compression=h.compression.alg if h.compression else None)
        _same_record(again, record, spec.compression)


def _same_record(again: bytes, record: bytes, compression: str | None) -> None:
    """Byte for byte; with the lz4 stage, whose bytes are not canonical (SPEC 4.8: another LZ4
    library version may write other blocks), at least the same header rules and decoded tensor."""
    if compression is None or again == record:  # the pinned lz4 gives the same bytes
        assert again == record
        return
    a, b = decode_block(again), decode_block(record)
    assert (a[0].codec, a[0].quant, a[0].shape, a[0].layout) == (b[0].codec, b[0].quant, b[0].shape, b[0].layout)
    assert torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
