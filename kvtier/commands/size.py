"""``kvtier size``: how many bytes a model's KV takes, and how many tokens each configured tier holds.

::

    MHA / GQA / MQA:  bytes/token = L * H_kv * (d_k + d_v) * esize     (= 2 * L * H_kv * d * esize)
    MLA:              bytes/token = L * (kv_lora_rank + rope dims) * esize

Quantizing codecs store a block as the sections of SPEC.md §5 (codes, scales, mins, kept rope
dims); their exact lengths come from :func:`kvtier_protocol.codec_plan.section_lengths`, so a
block is the unit here (``--block-tokens``). A tier holds whole blocks: host slots are rounded up
to 4 KiB pages, GPU slots to 256 bytes, and a disk record is the block's header plus payload.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
          "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
HOST_ALIGN, GPU_ALIGN = 4096, 256  # slot alignment of the host and GPU tiers (kvtier.daemon.store)


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The KV shape of one model shard.

    Attributes:
        layers: attention layers.
        kv_heads: KV heads (after tensor parallelism); 1 for MLA.
        head_dim: K head dim; for MLA the latent width (``kv_lora_rank``).
        head_dim_v: V head dim (MHA); 0 for MLA.
        rope_dim: MLA's decoupled RoPE dims stored beside the latent; 0 for MHA.
        dtype: element type name (``kvtier_protocol.dtypes``).
        mla: multi-head latent attention.
    """

    layers: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    rope_dim: int
    dtype: str
    mla: bool

    @property
    def esize(self) -> int:
        from kvtier_protocol.dtypes import dtype_size

        return dtype_size(self.dtype, ValueError)

    def bytes_per_token(self) -> int:
        """Raw KV bytes of one token over all layers."""
        if self.mla:
            return self.layers * (self.head_dim + self.rope_dim) * self.esize
        return self.layers * self.kv_heads * (self.head_dim + self.head_dim_v) * self.esize

    def block_bytes(self, codec: str, block_tokens: int) -> int:
        """Payload bytes of one block of ``block_tokens`` tokens stored with ``codec``.

        Raises:
            ValueError: the codec cannot store this geometry (MHA with d_v != d_k, or fp8 KV,
                which the namespace rules keep raw: SPEC.md §2.1).
        """
        if codec == "raw":
            return self.bytes_per_token() * block_tokens
        from kvtier_protocol.codec_plan import default_quant, section_lengths
        from kvtier_protocol.errors import CodecError
        from kvtier_protocol.namespace import LOSSY_SOURCE_DTYPES

        if self.dtype not in LOSSY_SOURCE_DTYPES:
            raise ValueError(f"codec {codec} needs KV in {', '.join(LOSSY_SOURCE_DTYPES)}; "
                             f"{self.dtype} is stored raw only")
        if not self.mla and self.head_dim_v != self.head_dim:
            raise ValueError(f"codec {codec} needs d_v == d_k (got {self.head_dim_v} and {self.head_dim})")
        quant = default_quant(codec, mla=self.mla, rope_dims=self.rope_dim)
        shape = ((self.layers, block_tokens, self.head_dim + self.rope_dim) if self.mla
                 else (self.layers, 2, self.kv_heads, block_tokens, self.head_dim))
        try:
            return sum(n for _, n in section_lengths(codec, quant, shape, self.dtype, self.mla))
        except CodecError as e:
            raise ValueError(e.message) from None


def geometry_from_hf(cfg: dict[str, Any], *, dtype: str | None = None, tp: int = 1) -> KVGeometry:
    """The KV geometry named by a Hugging Face ``config.json`` (its ``text_config`` when nested).

    Reads ``num_hidden_layers``, ``num_key_value_heads`` (else ``num_attention_heads``),
    ``head_dim`` (else ``hidden_size / num_attention_heads``), ``v_head_dim``, and for MLA
    (DeepSeek) ``kv_lora_rank`` and ``qk_rope_head_dim``; ``torch_dtype`` / ``dtype``.

    Raises:
        ValueError: a required field is missing or not a positive integer.
    """
    cfg = cfg.get("text_config") or cfg

    def num(*names: str, default: int | None = None) -> int:
        for name in names:
            v = cfg.get(name)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"config field {name} must be a non-negative integer, got {v!r}")
                return v
        if default is None:
            raise ValueError(f"config has none of {', '.join(names)}")
        return default

    layers = num("num_hidden_layers", "n_layer", "num_layers")
    name = dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if cfg.get("kv_lora_rank"):
        return KVGeometry(layers, 1, num("kv_lora_rank"), 0, num("qk_rope_head_dim", default=64), name, True)
    heads = num("num_attention_heads", "n_head")
    kv_heads = num("num_key_value_heads", "num_kv_heads", default=heads)
    head_dim = num("head_dim", default=0) or num("hidden_size", "n_embd") // max(heads, 1)
    return KVGeometry(layers, max(1, kv_heads // tp), head_dim, num("v_head_dim", default=head_dim), 0, name, False)


def tier_tokens(capacity: int, block_footprint: int, block_tokens: int) -> int:
    """Tokens a tier of ``capacity`` bytes holds in whole blocks of ``block_footprint`` bytes."""
    return capacity // block_footprint * block_tokens if block_footprint else 0


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def record_header_bytes(geo: KVGeometry, codec: str, block_tokens: int) -> int:
    """Length of a typical encoded block header: a disk record's overhead over its payload.

    With a parent hash and without the optional ``ns_fields`` map (which adds a few hundred bytes).
    """
    from kvtier_protocol.codec_plan import default_quant, section_lengths
    from kvtier_protocol.header import BlockHeader, Section, encode_header

    quant = default_quant(codec, mla=geo.mla, rope_dims=geo.rope_dim)
    if geo.mla:
        layout, shape = "mla-latent", (geo.layers, block_tokens, geo.head_dim + geo.rope_dim)
    else:
        layout, shape = "canonical", (geo.layers, 2, geo.kv_heads, block_tokens, geo.head_dim)
    sections, offset = [], 0
    for name, n in section_lengths(codec, quant, shape, geo.dtype, geo.mla):
        sections.append(Section(name, offset, n))
        offset += n
    h = BlockHeader(b"\0" * 16, b"\xff" * 32, b"\xff" * 32, block_tokens, layout, shape, geo.dtype, codec,
                    tuple(sections), offset, (1 << 64) - 1, quant=quant)
    return len(encode_header(h))


def report(geo: KVGeometry, *, tokens: int, block_tokens: int, codecs: list[str],
           tiers: dict[str, int]) -> dict[str, Any]:
    """Every figure ``kvtier size`` prints, as a JSON-able dict."""
    rows = []
    for codec in codecs:
        try:
            block = geo.block_bytes(codec, block_tokens)
        except ValueError as e:
            rows.append({"codec": codec, "error": str(e)})
            continue
        header = record_header_bytes(geo, codec, block_tokens)
        footprint = {"host": _round_up(block, HOST_ALIGN), "gpu": _round_up(block, GPU_ALIGN), "disk": block + header}
        rows.append({"codec": codec, "block_bytes": block, "bytes_per_token": block / block_tokens,
                     "bytes_for_tokens": math.ceil(block / block_tokens * tokens),
                     "tier_tokens": {t: tier_tokens(cap, footprint[t], block_tokens) for t, cap in tiers.items()}})
    return {"geometry": asdict(geo), "bytes_per_token": geo.bytes_per_token(), "tokens": tokens,
            "bytes_for_tokens": geo.bytes_per_token() * tokens, "block_tokens": block_tokens,
            "tiers": tiers, "codecs": rows}


def _human(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.4g} B"


def _print(r: dict[str, Any]) -> None:
    g = r["geometry"]
    dv = f"/{g['head_dim_v']}" if g["head_dim_v"] != g["head_dim"] else ""
    kind = (f"MLA, latent {g['head_dim']} + rope {g['rope_dim']}" if g["mla"]
            else f"{g['kv_heads']} KV heads x d {g['head_dim']}{dv}")
    print(f"{g['layers']} layers, {kind}, {g['dtype']}")
    print(f"KV per token: {r['bytes_per_token']} B ({_human(r['bytes_per_token'])}); "
          f"{r['tokens']} tokens: {_human(r['bytes_for_tokens'])}")
    tiers = list(r["tiers"])
    print(f"\n{'codec':<10}{'bytes/token':>14}{'block (' + str(r['block_tokens']) + ' tok)':>16}"
          f"{str(r['tokens']) + ' tokens':>16}" + "".join(f"{t + ' holds':>18}" for t in tiers))
    for row in r["codecs"]:
        if "error" in row:
            print(f"{row['codec']:<10}  n/a: {row['error']}")
            continue
        print(f"{row['codec']:<10}{_human(row['bytes_per_token']):>14}{_human(row['block_bytes']):>16}"
              f"{_human(row['bytes_for_tokens']):>16}" + "".join(f"{row['tier_tokens'][t]:>11,} tokens" for t in tiers))
    print("\ntiers: " + (", ".join(f"{t} {_human(c)}" for t, c in r["tiers"].items()) or "none configured"))


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``size`` to the ``kvtier`` command line."""
    p = subparsers.add_parser("size", help="KV-cache size calculator: bytes per token, tokens per tier",
                              description="KV bytes of a model (2*L*H_kv*d*T*bytes; MLA: L*(latent+rope)*T*bytes) "
                              "and how many tokens each configured tier holds. Give --model-config, or --layers "
                              "with --kv-heads/--head-dim (MHA) or --mla-latent (MLA).")
    p.add_argument("--model-config", metavar="JSON", help="a Hugging Face config.json")
    p.add_argument("--layers", type=int, help="attention layers (num_hidden_layers)")
    p.add_argument("--kv-heads", type=int, help="KV heads (num_key_value_heads)")
    p.add_argument("--head-dim", type=int, help="head dim of K (and V)")
    p.add_argument("--head-dim-v", type=int, help="head dim of V when it differs from K")
    p.add_argument("--mla-latent", type=int, metavar="RANK", help="MLA latent width (kv_lora_rank)")
    p.add_argument("--mla-rope", type=int, default=None, metavar="DIMS",
                   help="MLA rope dims (qk_rope_head_dim; default 64)")
    p.add_argument("--dtype", help="KV dtype: bf16, fp16, fp32, fp8 or a full name (default: the model's, else bf16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: KV heads per shard = H_kv / tp")
    p.add_argument("--tokens", type=int, default=1, metavar="T", help="tokens to size (default 1)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per stored block (default 16)")
    p.add_argument("--codec", action="append", metavar="NAME",
                   help="raw, int8, int4, int2, fp8_e4m3 or all (repeatable; default: raw, int8, int4)")
    p.add_argument("--config", metavar="FILE",
                   help="kvtier TOML whose tiers to fill (default: $KVTIER_CONFIG, else the embedded defaults)")
    p.add_argument("--host-bytes", metavar="SIZE", help="host tier size instead of the configured one")
    p.add_argument("--disk-bytes", metavar="SIZE", help="disk tier size instead of the configured one")
    p.add_argument("--gpu-bytes", metavar="SIZE", help="GPU tier size instead of the configured one")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)
    return p


def geometry_from_args(args: argparse.Namespace) -> KVGeometry:
    """The geometry from ``--model-config`` and the shape flags (a flag wins). Raises ValueError."""
    dtype = DTYPES.get(args.dtype, args.dtype) if args.dtype else None
    base: dict[str, Any] = {}
    if args.model_config:
        try:
            with open(args.model_config, encoding="utf-8") as f:
                base = asdict(geometry_from_hf(json.load(f), tp=args.tp))
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"cannot read {args.model_config}: {e}") from None
    elif args.layers is None:
        raise ValueError("give --model-config, or --layers with --kv-heads and --head-dim (or --mla-latent)")
    layers = args.layers if args.layers is not None else base["layers"]
    dtype = dtype or base.get("dtype", "bfloat16")
    if args.mla_latent is not None or base.get("mla"):
        rope = args.mla_rope if args.mla_rope is not None else base.get("rope_dim", 64)
        geo = KVGeometry(layers, 1, args.mla_latent or base["head_dim"], 0, rope, dtype, True)
    else:
        kv_heads = max(1, args.kv_heads // args.tp) if args.kv_heads else base.get("kv_heads")
        head_dim = args.head_dim or base.get("head_dim")
        if kv_heads is None or head_dim is None:
            raise ValueError("MHA needs --kv-heads and --head-dim")
        head_dim_v = args.head_dim_v or (None if args.head_dim else base.get("head_dim_v")) or head_dim
        geo = KVGeometry(layers, kv_heads, head_dim, head_dim_v, 0, dtype, False)
    if min(geo.layers, geo.kv_heads, geo.head_dim) < 1 or geo.rope_dim < 0:
        raise ValueError(f"layers, KV heads and head dim must be >= 1: {geo}")
    geo.esize  # an unknown dtype name raises ValueError here
    return geo


def run(args: argparse.Namespace) -> int:
    """Print the figures; exit status 2 on bad input."""
    from kvtier.daemon.config import ConfigError, load_config

    from kvtier_protocol.codec_plan import CODECS

    try:
        geo = geometry_from_args(args)
        codecs = list(CODECS) if args.codec and "all" in args.codec else args.codec or ["raw", "int8", "int4"]
        if unknown := [c for c in codecs if c not in CODECS]:
            raise ValueError(f"unknown codec(s) {unknown}; expected {', '.join(CODECS)} or all")
        if args.tokens < 0 or args.block_tokens < 1 or args.tp < 1:
            raise ValueError("--tokens must be >= 0, --block-tokens and --tp >= 1")
        flags = {"store.host_bytes": args.host_bytes, "store.disk_bytes": args.disk_bytes,
                 "store.gpu_bytes": args.gpu_bytes}
        cfg = load_config(args.config, overrides={k: v for k, v in flags.items() if v is not None}).store
    except (ValueError, ConfigError) as e:
        print(f"kvtier size: {e}", file=sys.stderr)
        return 2
    tiers = {"gpu": cfg.gpu_bytes, "host": cfg.host_bytes, "disk": cfg.disk_bytes if cfg.disk_path else 0}
    r = report(geo, tokens=args.tokens, block_tokens=args.block_tokens, codecs=codecs,
               tiers={t: c for t, c in tiers.items() if c})
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        _print(r)
    return 0
