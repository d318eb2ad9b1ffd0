"""Generate the golden block records in protocol/vectors/blocks/ (SPEC.md §4-§6, §10).

Run from the repository root: ``python protocol/vectors/gen_blocks.py``. Deterministic: the block
contents come from an integer formula (no RNG, no platform maths), hashes from sha256 of fixed
labels, and timestamps are fixed, so running it twice writes identical bytes.

Each vector is ``<name>.bin`` (one whole record: preamble + header map + payload) and
``<name>.json`` (what it is, the parameters, the expected header fields, and sha256 digests of the
record and of the decoded tensor's bytes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier_protocol.block import decode_block, encode_block, torch_dtype
from kvtier_protocol.header import decode_header, encode_header, split_record
from kvtier_protocol.layouts import Geometry, convert, get_layout
from kvtier_protocol.quant import QuantParams

OUT_DIR = Path(__file__).resolve().parent / "blocks"
NS_ID = hashlib.sha256(b"kvtier vector namespace").digest()[:16]
CREATED_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z


@dataclass(frozen=True, slots=True)
class VectorSpec:
    """One golden block: the source tensor's geometry, dtype and layout, and how it is stored."""

    name: str
    description: str
    layout: str
    dtype: str
    geometry: Geometry
    codec: str = "raw"
    quant: QuantParams | None = None
    first: bool = False  # no parent hash
    created: bool = False  # record the optional "created" key
    extra: tuple[tuple[str, Any], ...] = ()  # unknown future keys, to exercise the growth rule
    scale_exp: int = 0  # the source formula's values times 2**scale_exp (exact: a power of two)
    compression: str | None = None  # the lossless stage after the codec (SPEC 4.8)


MHA_SMALL = Geometry(num_layers=2, num_tokens=4, num_heads=2, head_dim=8)
MHA_QUANT = Geometry(num_layers=2, num_tokens=64, num_heads=1, head_dim=64)
MLA_SMALL = Geometry(num_layers=2, num_tokens=4, latent_dim=16)
MLA_QUANT = Geometry(num_layers=2, num_tokens=8, latent_dim=160)

SPECS: tuple[VectorSpec, ...] = (
    VectorSpec("raw-bf16-canonical", "raw bfloat16 MHA block in the canonical layout, first block "
               "of a prefix (parent nil), with the optional created key", "canonical", "bfloat16",
               MHA_SMALL, first=True, created=True),
    VectorSpec("raw-f16-vllm-nhc", "raw float16 block as vLLM 0.33 LBNHC pages hold it",
               "vllm-nhc", "float16", MHA_SMALL),
    VectorSpec("raw-bf16-vllm-hnc", "raw bfloat16 block as vLLM 0.33 LBHNC pages hold it",
               "vllm-hnc", "bfloat16", MHA_SMALL),
    VectorSpec("raw-f32-vllm-flash", "raw float32 block as legacy vLLM FlashAttention caches hold it",
               "vllm-flash", "float32", MHA_SMALL),
    VectorSpec("raw-bf16-sglang-page-first", "raw bfloat16 page of an SGLang page_first host pool",
               "sglang-page-first", "bfloat16", MHA_SMALL),
    VectorSpec("raw-bf16-sglang-page-first-direct", "raw bfloat16 page of an SGLang "
               "page_first_direct host pool", "sglang-page-first-direct", "bfloat16", MHA_SMALL),
    VectorSpec("raw-fp8e4m3-canonical", "raw float8_e4m3fn block (an fp8 KV cache stored as is)",
               "canonical", "float8_e4m3fn", MHA_SMALL),
    VectorSpec("raw-bf16-mla-latent", "raw bfloat16 MLA latent block", "mla-latent", "bfloat16",
               MLA_SMALL),
    VectorSpec("raw-bf16-future-key", "raw bfloat16 block whose header carries an unknown key "
               "after the v1 keys; readers ignore it and re-encode it unchanged", "canonical",
               "bfloat16", MHA_SMALL, extra=(("x-future", [1, "two"]),)),
    VectorSpec("int8-bf16-from-vllm-nhc", "int8 (K per channel, V per token, whole axes) of a "
               "block given in vllm-nhc; stored canonical", "vllm-nhc", "bfloat16", MHA_QUANT,
               "int8"),
    VectorSpec("int4-f16-canonical", "int4, groups of 32 (K per channel along tokens, V per token "
               "along channels)", "canonical", "float16", MHA_QUANT, "int4"),
    VectorSpec("int4-bf16-g64-from-vllm-flash", "int4 with K groups of 64 tokens and V groups of "
               "16 channels, float32 scales", "vllm-flash", "bfloat16", MHA_QUANT, "int4",
               QuantParams(4, "channel", "token", 64, 16, "float32")),
    VectorSpec("int2-bf16-canonical", "int2 (experimental), groups of 32", "canonical", "bfloat16",
               MHA_QUANT, "int2"),
    VectorSpec("fp8e4m3-bf16-from-sglang-page-first", "fp8_e4m3 with one float32 scale per (layer, "
               "kv, head) of a block given in sglang-page-first", "sglang-page-first", "bfloat16",
               MHA_QUANT, "fp8_e4m3"),
    VectorSpec("int8-bf16-mla-rope", "int8 MLA latent: 128 latent dims per token in one group, "
               "32 RoPE dims kept raw", "mla-latent", "bfloat16", MLA_QUANT, "int8",
               QuantParams(8, "token", "token", 128, 128, "float16", 32)),
    VectorSpec("int4-bf16-mla", "int4 MLA latent, groups of 128 along the latent (last group "
               "ragged: 32)", "mla-latent", "bfloat16", MLA_QUANT, "int4"),
    VectorSpec("fp8e4m3-bf16-mla", "fp8_e4m3 MLA latent, one float32 scale per 128 values",
               "mla-latent", "bfloat16", MLA_QUANT, "fp8_e4m3"),
    VectorSpec("raw-bf16-sglang-page-head", "raw bfloat16 page of an SGLang page_head host pool",
               "sglang-page-head", "bfloat16", MHA_SMALL),
    VectorSpec("raw-bf16-sglang-mla-page-first", "raw bfloat16 MLA page of an SGLang page_first "
               "host pool", "sglang-mla-page-first", "bfloat16", MLA_SMALL),
    VectorSpec("raw-fp8e5m2-canonical", "raw float8_e5m2 block (an fp8 KV cache stored as is)",
               "canonical", "float8_e5m2", MHA_SMALL),
    VectorSpec("raw-int8-canonical", "raw int8 block: elements are the low byte of u_i, as two's "
               "complement", "canonical", "int8", MHA_SMALL),
    VectorSpec("raw-uint8-vllm-nhc", "raw uint8 block in vllm-nhc: elements are the low byte of "
               "u_i", "vllm-nhc", "uint8", MHA_SMALL),
    VectorSpec("int8-f32-canonical", "int8 of a float32 source, default parameters (float16 "
               "scales fit)", "canonical", "float32", MHA_QUANT, "int8"),
    VectorSpec("int4-f32-tiny-scale-fallback", "int4 of a float32 source whose values are the "
               "formula's times 2^-16: default parameters ask for float16 scales, every scale is "
               "below 2^-14, so the whole block is stored with float32 scales (SPEC 5.4 step 4)",
               "canonical", "float32", MHA_QUANT, "int4", scale_exp=-16),
    VectorSpec("int8-fp8e4m3-canonical", "int8 of a float8_e4m3fn source: a quantizing codec "
               "accepts fp8 input (SPEC 5.1); the decoded tensor is float8_e4m3fn again",
               "canonical", "float8_e4m3fn", MHA_QUANT, "int8"),
    VectorSpec("raw-bf16-lz4", "raw bfloat16 block with the lz4 stage (SPEC 4.8): the payload "
               "byte-shuffled with stride 2 (the exponent bytes together) and stored as one LZ4 "
               "block; preamble flag bit 0 set", "canonical", "bfloat16", MHA_QUANT,
               compression="lz4"),
    VectorSpec("int8-bf16-lz4", "int8 with the lz4 stage after the codec: the codes (stride 1: not "
               "shuffled) and the float16 scales and mins (stride 2) each stored as one LZ4 block",
               "canonical", "bfloat16", MHA_QUANT, "int8", compression="lz4"),
)


INTEGER_DTYPES = ("int8", "uint8")

SOURCE_FORMULA = (
    "u[i] = (i*2654435761 + 12345) mod 2^32, i = row-major index in the canonical layout. Floating "
    "dtypes: x[i] = dtype(float32(u[i] / 2^32 * 8 - 4) * 2^source_scale_exp), the inner value "
    "exact in float64, rounded once to float32 and then once to dtype (round-to-nearest-even); "
    "int8 / uint8: x[i] = the low byte of u[i] (int8: as two's complement). Then converted to "
    "params.layout")


def source_tensor(spec: VectorSpec) -> torch.Tensor:
    """The block's contents in ``spec.layout``: ``u_i = (i * 2654435761 + 12345) mod 2^32``
    over the canonical element index ``i``. Floating dtypes: ``u_i / 2^32 * 8 - 4`` (exact in
    float64), rounded to float32, times ``2^scale_exp`` (exact), rounded to the dtype; integer
    dtypes: the low byte of ``u_i``. Every implementation can rebuild it exactly (SOURCE_FORMULA)."""
    canonical = get_layout(spec.layout).canonical_name
    shape = get_layout(canonical).shape_for(spec.geometry)
    i = torch.arange(math.prod(shape), dtype=torch.int64)
    u = (i * 2654435761 + 12345) % (1 << 32)
    if spec.dtype in INTEGER_DTYPES:
        x = (u & 0xFF).to(torch.uint8).view(torch_dtype(spec.dtype)).reshape(shape)
        return convert(x, canonical, spec.layout)
    x = (u.to(torch.float64) / float(1 << 32) * 8.0 - 4.0).to(torch.float32)
    x = (x * 2.0 ** spec.scale_exp).to(torch_dtype(spec.dtype)).reshape(shape)
    return convert(x, canonical, spec.layout)


def _label_hash(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def encode_spec(spec: VectorSpec) -> bytes:
    """The record of one vector."""
    record = encode_block(source_tensor(spec), ns_id=NS_ID, chain_hash=_label_hash(spec.name),
                          parent_hash=None if spec.first else _label_hash(spec.name + "/parent"),
                          layout=spec.layout, codec=spec.codec, quant=spec.quant,
                          created_ms=CREATED_MS if spec.created else None, compression=spec.compression)
    if not spec.extra:
        return record
    h, payload = split_record(record)
    return encode_header(dataclasses.replace(h, extra=spec.extra)) + bytes(payload)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def describe(spec: VectorSpec, record: bytes) -> dict[str, Any]:
    """The JSON description of one vector (everything a test or another implementation checks)."""
    h, offset = decode_header(record)
    _, decoded = decode_block(record)
    source = source_tensor(spec)
    as_source = convert(decoded, h.layout, spec.layout)
    err = (as_source.double() - source.double()).abs().max().item()
    out = {
        "name": spec.name,
        "description": spec.description,
        "format_version": 1,
        "params": {
            "layout": spec.layout, "dtype": spec.dtype, "codec": spec.codec,
            "shape": list(source.shape),
            "quant": spec.quant.to_wire() if spec.quant is not None else None,
            "ns_id": NS_ID.hex(), "chain_hash": h.chain_hash.hex(),
            "parent_hash": h.parent_hash.hex() if h.parent_hash is not None else None,
            "created_ms": h.created_ms, "extra": [list(kv) for kv in spec.extra],
            "source": SOURCE_FORMULA, "source_scale_exp": spec.scale_exp,
            "source_sha256": _sha(source),
        },
        "header": {
            "header_len": offset - 20, "payload_offset": offset, "layout": h.layout,
            "shape": list(h.shape), "dtype": h.dtype, "codec": h.codec, "num_tokens": h.num_tokens,
            "sections": [[s.name, s.offset, s.length] for s in h.sections],
            "payload_len": h.payload_len, "checksum_alg": h.checksum_alg,
            "checksum": f"{h.checksum:016x}",
            "quant": h.quant.to_wire() if h.quant is not None else None,
        },
        "record": {"length": len(record), "sha256": hashlib.sha256(record).hexdigest(),
                   "header_hex": record[:offset].hex()},
        "decoded": {"layout": h.layout, "shape": list(decoded.shape), "dtype": h.dtype,
                    "sha256": _sha(decoded), "sha256_in_source_layout": _sha(as_source),
                    "max_abs_error": err},
    }
    if h.compression is not None:  # only where present: the other vectors' descriptions predate it
        out["params"]["compression"] = spec.compression
        out["header"]["compression"] = h.compression.to_wire()
    return out


def build() -> dict[str, tuple[bytes, dict[str, Any]]]:
    """Every vector: name -> (record bytes, JSON description)."""
    out = {}
    for spec in SPECS:
        record = encode_spec(spec)
        out[spec.name] = (record, describe(spec, record))
    return out


def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, (record, desc) in build().items():
        (OUT_DIR / f"{name}.bin").write_bytes(record)
        (OUT_DIR / f"{name}.json").write_text(json.dumps(desc, indent=2) + "\n")
        print(f"{name}: {len(record)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
