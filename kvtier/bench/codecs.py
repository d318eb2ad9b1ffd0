"""`kvtier bench codecs`: size, error and speed of every KV codec on synthetic KV.

The data follows reference/peers.md §6: Gaussian K with 4 outlier channels scaled x8, V with
per-token scales (log-normal). It is NOT real model KV; rerun on real KV before choosing a codec.

Rows per codec:
  * ``size ratio`` (x): raw bytes / encoded bytes, next to raw's 1.0;
  * ``rel RMSE`` (%): ||decode(encode(x)) - x|| / ||x||, next to raw's 0.0; the ratio column is
    baseline / kvtier as for latencies (0 = worse than lossless, 1 = lossless);
  * ``encode`` / ``decode`` (GB/s of raw bytes), next to a torch ``copy_`` of the same bytes
    (memcpy), run alternately over a rotating working set so neither side measures the cache.
"""

from __future__ import annotations

import argparse
import math

import torch

from kvtier.bench.report import Row, SuiteResult, Timer, alternate, gbps, progress, throughput_row
from kvtier_protocol.codecs import CODECS, Encoded, decode, encode

DESCRIPTION = "KV codecs (raw, int8, int4, int2, fp8_e4m3): size ratio, error, encode/decode GB/s vs memcpy"

OUTLIER_CHANNELS = (3, 17, 64, 100)
"""Channels of K scaled x8 (taken modulo D), as in the peers.md synthetic check."""


def synthetic_kv(layers: int, heads: int, tokens: int, head_dim: int, *, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> torch.Tensor:
    """Canonical ``[L, 2, H, T, D]`` KV: Gaussian K with 4 outlier channels x8, V with per-token
    log-normal scales. Deterministic for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, heads, tokens, head_dim, generator=gen)
    k[..., sorted({c % head_dim for c in OUTLIER_CHANNELS})] *= 8.0
    v = torch.randn(layers, heads, tokens, head_dim, generator=gen)
    v *= torch.exp(0.5 * torch.randn(layers, heads, tokens, 1, generator=gen))
    return torch.stack([k, v], 1).to(dtype)


def rel_rmse(y: torch.Tensor, x: torch.Tensor) -> float:
    """||y - x||_2 / ||x||_2, in float64."""
    x64, y64 = x.double(), y.double()
    return float((y64 - x64).norm() / x64.norm())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=None, help="L (default 4; --quick 2)")
    parser.add_argument("--heads", type=int, default=None, help="KV heads H (default 8; --quick 4)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per block T (default 256; --quick 64)")
    parser.add_argument("--head-dim", type=int, default=128, help="D (default 128)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codecs to run")
    parser.add_argument("--working-set-mib", type=int, default=None,
                        help="total size of the rotating source blocks (default 256; --quick 8)")
    parser.add_argument("--device", default="cpu", help="torch device for the codec math (cpu, cuda)")
    parser.add_argument("--seed", type=int, default=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sections(enc: Encoded) -> dict[str, memoryview]:
    return {name: memoryview(t.numpy()) for name, t in enc.sections}


def run(args: argparse.Namespace) -> SuiteResult:
    quick = bool(args.quick)
    layers = args.layers or (2 if quick else 4)
    heads = args.heads or (4 if quick else 8)
    tokens = args.tokens or (64 if quick else 256)
    reps = args.repetitions or (3 if quick else 5)
    ws_mib = args.working_set_mib or (8 if quick else 256)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    for c in codecs:
        if c not in CODECS:
            raise SystemExit(f"unknown codec {c!r}; choose from {', '.join(CODECS)}")

    base = synthetic_kv(layers, heads, tokens, args.head_dim, dtype=dtype, seed=args.seed).to(device)
    shape = tuple(base.shape)
    nbytes = base.numel() * base.element_size()
    count = max(2, math.ceil(ws_mib * 2**20 / nbytes))
    progress(f"codecs: block {list(shape)} {args.dtype} = {nbytes / 2**20:.2f} MiB, "
             f"{count} blocks in rotation ({count * nbytes / 2**20:.0f} MiB), device {device}")
    # Distinct buffers (same content): the rotation defeats the cache for codec and memcpy alike.
    srcs = [base.clone() for _ in range(count)]
    dsts = [torch.empty_like(base) for _ in range(count)]

    def memcpy() -> float:
        _sync(device)
        with Timer() as t:
            for s, d in zip(srcs, dsts):
                d.copy_(s)
            _sync(device)
        return gbps(nbytes * count, t.seconds)

    result = SuiteResult("codecs")
    for codec in codecs:
        progress(f"codecs: {codec}")
        enc = encode(base, codec)
        back = decode(_sections(enc), codec=codec, quant=enc.quant, shape=shape, dtype=args.dtype,
                      device=device)
        ratio = nbytes / enc.nbytes
        err = rel_rmse(back.cpu(), base.cpu()) * 100.0
        result.rows.append(Row(codec, "size ratio", "x", ratio, "raw", 1.0, ratio))
        result.rows.append(Row(codec, "rel RMSE", "%", err, "raw", 0.0, 1.0 if err == 0 else 0.0))

        def enc_all() -> float:
            _sync(device)
            with Timer() as t:
                for s in srcs:
                    encode(s, codec)
            return gbps(nbytes * count, t.seconds)

        encoded = [_sections(encode(s, codec)) for s in srcs]
        quant = enc.quant

        def dec_all() -> float:
            _sync(device)
            with Timer() as t:
                for secs in encoded:
                    decode(secs, codec=codec, quant=quant, shape=shape, dtype=args.dtype, device=device)
                _sync(device)
            return gbps(nbytes * count, t.seconds)

        kv, mc = alternate(enc_all, memcpy, repetitions=reps)
        result.rows.append(throughput_row(codec, "encode", "GB/s", kv, "memcpy", mc))
        kv, mc = alternate(dec_all, memcpy, repetitions=reps)
        result.rows.append(throughput_row(codec, "decode", "GB/s", kv, "memcpy", mc))
        del encoded
    return result


__all__ = ["DESCRIPTION", "add_arguments", "run", "synthetic_kv", "rel_rmse"]
