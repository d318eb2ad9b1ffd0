"""`kvtier bench codecs`: size, error and speed of every KV codec, and of the lz4 stage after it.

The data (``--kv``): ``synthetic`` follows reference/peers.md §6: Gaussian K with 4 outlier
channels scaled x8, V with per-token scales (log-normal); ``engine`` is the KV the reference engine
computes for a random prompt on a random-weight Llama-style checkpoint of the block's geometry
(K after RoPE, V). Neither is a trained model's KV; rerun on real KV before choosing a codec.

Rows per codec:
  * ``size ratio`` (x): raw bytes / encoded bytes, next to raw's 1.0;
  * ``rel RMSE`` (%): ||decode(encode(x)) - x|| / ||x||, next to raw's 0.0; the ratio column is
    baseline / kvtier as for latencies (0 = worse than lossless, 1 = lossless);
  * ``encode`` / ``decode`` (GB/s of raw bytes), next to a torch ``copy_`` of the same bytes
    (memcpy), run alternately over a rotating working set so neither side measures the cache;
    ``--impl torch`` times the torch reference path instead of the C loops (same bytes);
  * ``lz4 ratio`` (x): the codec's sections / the same after byte shuffle + LZ4
    (kvtier_protocol.compression, SPEC.md §4.8; sections it does not shrink by 1/32 stay verbatim);
  * ``lz4 compress`` / ``lz4 decompress`` (GB/s of the block's raw bytes, so their times add to
    encode's and decode's), next to memcpy.
"""

from __future__ import annotations

import argparse
import math

import torch

from kvtier.bench.report import Row, SuiteResult, Timer, alternate, gbps, progress, throughput_row
from kvtier_protocol.block import section_stride
from kvtier_protocol.codecs import CODECS, NATIVE, Encoded, decode, encode
from kvtier_protocol.compression import compress_sections, decompress_sections

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
    parser.add_argument("--kv", choices=("synthetic", "engine"), default="synthetic",
                        help="the block: synthetic (Gaussian, outlier channels) or the reference engine's KV "
                             "of a random-weight checkpoint")
    parser.add_argument("--impl", choices=("auto", "torch"), default="auto",
                        help="auto: the C loops where built (kvtier_protocol._codecs); torch: the reference path")


def engine_kv(layers: int, heads: int, tokens: int, head_dim: int, *, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Canonical ``[L, 2, H, T, D]`` KV of one block as the reference engine computes it: a random
    prompt on a random-weight Llama-style checkpoint with these dims (GQA, 2 query heads per KV head)."""
    import shutil
    import tempfile
    from pathlib import Path

    from kvtier.bench.precision import PrefixKV
    from kvtier.engine.checkpoint import make_random_checkpoint
    from kvtier.engine.config import ModelConfig
    from kvtier.engine.engine import Engine
    from kvtier.engine.sampler import SamplingParams
    from kvtier_protocol.layouts import to_canonical

    hidden = 2 * heads * head_dim
    cfg = ModelConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=2 * heads, num_kv_heads=heads, head_dim=head_dim, rope_theta=500000.0,
                      max_position_embeddings=2 * tokens + 16)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-codecs-", dir="/tmp"))
    try:
        make_random_checkpoint(work, cfg, seed=seed, dtype=dtype)
        with Engine(work, dtype=dtype, block_tokens=tokens, num_pages=4, layerwise=False) as engine:
            prompt = torch.randint(0, cfg.vocab_size, (tokens + 1,), generator=torch.Generator().manual_seed(seed))
            engine.generate([prompt.tolist()], SamplingParams(max_tokens=1))
            prefix = PrefixKV(engine, prompt.tolist(), 1)
            return to_canonical(prefix.read(prefix.pages[0]), prefix.layout).contiguous()
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
    native = None if args.impl == "auto" else False
    progress(f"codecs: {args.kv} KV, {'C loops' if NATIVE and native is None else 'torch'} path")

    make = engine_kv if args.kv == "engine" else synthetic_kv
    base = make(layers, heads, tokens, args.head_dim, dtype=dtype, seed=args.seed).to(device)
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
        enc = encode(base, codec, native=native)
        back = decode(_sections(enc), codec=codec, quant=enc.quant, shape=shape, dtype=args.dtype,
                      device=device, native=native)
        ratio = nbytes / enc.nbytes
        err = rel_rmse(back.cpu(), base.cpu()) * 100.0
        result.rows.append(Row(codec, "size ratio", "x", ratio, "raw", 1.0, ratio))
        result.rows.append(Row(codec, "rel RMSE", "%", err, "raw", 0.0, 1.0 if err == 0 else 0.0))

        def enc_all() -> float:
            _sync(device)
            with Timer() as t:
                for s in srcs:
                    encode(s, codec, native=native)
            return gbps(nbytes * count, t.seconds)

        encoded = [_sections(encode(s, codec, native=native)) for s in srcs]
        quant = enc.quant

        def dec_all() -> float:
            _sync(device)
            with Timer() as t:
                for secs in encoded:
                    decode(secs, codec=codec, quant=quant, shape=shape, dtype=args.dtype, device=device,
                           native=native)
                _sync(device)
            return gbps(nbytes * count, t.seconds)

        kv, mc = alternate(enc_all, memcpy, repetitions=reps)
        result.rows.append(throughput_row(codec, "encode", "GB/s", kv, "memcpy", mc))
        kv, mc = alternate(dec_all, memcpy, repetitions=reps)
        result.rows.append(throughput_row(codec, "decode", "GB/s", kv, "memcpy", mc))
        _lz4_rows(result, codec, enc, encoded, args.dtype, nbytes, memcpy, reps)
        del encoded
    return result


def _lz4_rows(result: SuiteResult, codec: str, enc: Encoded, encoded: list[dict[str, memoryview]], dtype: str,
              nbytes: int, memcpy, reps: int) -> None:
    """Ratio and speed of the lz4 stage on this codec's sections (the same rotation of blocks)."""
    strides = [section_stride(name, dtype, enc.quant) for name, _ in enc.sections]
    stored, comp = compress_sections([v for v in encoded[0].values()], strides)
    ratio = enc.nbytes / sum(memoryview(p).nbytes for p in stored)
    result.rows.append(Row(codec, "lz4 ratio", "x", ratio, "no lz4", 1.0, ratio))
    packed = [compress_sections(list(secs.values()), strides) for secs in encoded]

    def compress_all() -> float:
        with Timer() as t:
            for secs in encoded:
                compress_sections(list(secs.values()), strides)
        return gbps(nbytes * len(encoded), t.seconds)

    def decompress_all() -> float:
        with Timer() as t:
            for parts, c in packed:
                decompress_sections(c, parts)
        return gbps(nbytes * len(encoded), t.seconds)

    kv, mc = alternate(compress_all, memcpy, repetitions=reps)
    result.rows.append(throughput_row(codec, "lz4 compress", "GB/s", kv, "memcpy", mc))
    kv, mc = alternate(decompress_all, memcpy, repetitions=reps)
    result.rows.append(throughput_row(codec, "lz4 decompress", "GB/s", kv, "memcpy", mc))


__all__ = ["DESCRIPTION", "add_arguments", "engine_kv", "run", "synthetic_kv", "rel_rmse"]
