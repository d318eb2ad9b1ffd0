"""`kvtier bench precision`: what a lossy codec on stored KV does to the next tokens.

For the reference engine (kvtier/engine) on two random-weight checkpoints, a Llama-style GQA model
and a DeepSeek-V2-style MLA model, each codec chain is applied to the KV of a prompt's prefix the
way a tier would store and load it, and generation continues from that KV:

1. the prompt (``--prefix-blocks`` full blocks and a 5-token tail) is prefilled, which leaves the
   prefix's blocks in the engine's page cache;
2. every prefix block is taken out of its pages in the engine's block layout (``vllm-flash`` or
   ``mla-latent``), encoded into a kvtier block record with the chain's codec
   (``kvtier_protocol.block.encode_block``, MLA with the namespace's ``mla_rope_dim``), decoded
   again, and written back (a chain of several codecs re-encodes the decoded tensor each time, as
   a block demoted host -> disk -> remote would be);
3. the next ``--tokens`` tokens are scored teacher-forced: for k = 0..N-1 the logits after
   ``prompt + ref[:k]`` (the reference's greedy tokens), each a prefill that reuses the modified
   prefix pages (checked: the engine reports the prefix as shared, never recomputed).

So the codecs run through ``kvtier_protocol`` directly, not through a daemon: the bytes are those
the connector would store (same records), without the sockets. The reference is the ``raw`` chain
(a raw record round trip, exact: its rows must show 100 % and KL 0).

Random weights give near-uniform next-token distributions that hide errors, so the LM head is
scaled (the smallest factor of LM_HEAD_SCALES whose greedy continuation has a mean entropy below
ENTROPY_TARGET nats); the scale and the measured entropy are reported.

Each model runs in each of ``--dtypes`` (weights and KV; default bfloat16, what engines store, and
float32). The ``ulp`` chain moves every other KV element by one unit in the last place of its
dtype (:func:`nudge_ulp`): the smallest change a stored block can carry, so its KL is the floor
set by the engine's own rounding — in bfloat16 about as large as int8's whole error, in float32
far below it. Cases are ``<model> <bf16|f32> <chain>``.

Rows, per model, dtype and chain: ``top-1 agreement`` (%), ``KL to raw`` (mean KL(p_raw ||
p_chain), nats, next to the 1e-3 target), ``KL over the ulp floor`` (the same KL next to the
``ulp`` chain's, when that chain runs), ``max logit error`` (max |logit - raw logit| over positions
and vocabulary, next to the raw logits' standard deviation), ``tokens per GiB`` (from the records'
sizes, header included, next to raw's). And per model and dtype its ``entropy`` and ``lm head
scale``.

Two more parts run the daemon's store (:class:`~kvtier.daemon.store.store.TieredStore`: a
shared-memory host tier and an O_DIRECT disk tier in a temporary directory) with a raw disk tier
(the baseline) and each lossy disk tier of ``--disk-codecs`` (raw in host, the codec below it:
``int8``, ``int8/token`` with K per token, ``int8+lz4``) side by side; each metric below is named
after the lossy tier, e.g. ``demotion throughput int8/token``:

* ``demotion`` (``--parts``): the host tier holds ``--demotion-host-blocks`` blocks of a
  Llama-3-8B-shaped KV block (32 layers, 8 KV heads of 128, 16 tokens: 2 MiB of bfloat16; --quick
  a small one); ``--demotion-blocks`` more are put in batches of 4, each batch evicting as many to
  disk: the store's own demotion path (verified copy; with int8 the re-encode and the verification
  of the new record; the write). Row ``demotion throughput`` (MiB/s of host blocks demoted, raw
  bytes) int8 next to raw, alternating runs on fresh stores, median; target ratio 0.9. Row
  ``tokens per GiB of disk`` after the fill, from the disk tier's own charge (headers, file
  alignment) and its block count.
* ``zipf``: ``--zipf-docs`` documents of ``--zipf-doc-blocks`` blocks (the same 2 MiB blocks;
  --quick small ones), each request one document drawn with Zipf
  weights 1/rank^``--zipf-s``; host and disk tiers together hold about half the documents' raw
  bytes (host ``--zipf-host-blocks``, disk the rest), so what fits decides the hit rate. Per
  request: ``acquire`` of the document's stored prefix (disk blocks promoted into host, verified),
  each block decoded to bfloat16 as an engine loads it (``decode_block``: int8 blocks dequantized),
  ``release``; then the missing blocks are put (reserve, copy, commit: evicting, demoting,
  re-encoding). TTFT = the measured load plus a MODELED prefill of the missing tokens at
  ``--prefill-tokens-per-s`` (default 10,000: an 8B model on one datacenter GPU): the reference
  engine on two shared CPU cores would measure the CPU, not the cache. Rows ``hit rate`` (% of
  requested tokens served from the store), ``mean TTFT`` (ms; medians of ``--repetitions`` / 2
  alternating runs), ``tokens per GiB of disk`` (at the end), int8 next to raw; every run sees
  the same request sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.bench.report import Row, Samples, SuiteResult, alternate, latency_row, progress, throughput_row
from kvtier.daemon.store.config import StoreConfig, tier_quant
from kvtier.daemon.store.store import TieredStore
from kvtier.daemon.store.types import Tier
from kvtier.engine.checkpoint import make_random_checkpoint
from kvtier.engine.config import ModelConfig
from kvtier.engine.engine import Engine
from kvtier.engine.sampler import SamplingParams
from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.header import encode_header, split_record

DESCRIPTION = ("top-1 agreement, KL and max logit error of lossy KV codecs (reference engine, GQA and MLA); "
               "demotion throughput and a Zipf workload with an int8 disk tier")

CHAINS: dict[str, tuple[str, ...]] = {
    "raw": ("raw",),
    "ulp": ("ulp",),
    "raw>int8": ("raw", "int8"),
    "raw>int8>int8": ("raw", "int8", "int8"),
    "raw>int8/token": ("raw", "int8/token"),
    "int4": ("int4",),
    "fp8_e4m3": ("fp8_e4m3",),
}
"""Codec chains: each codec encodes the previous one's decoded tensor (host raw -> disk int8 -> a
remote tier re-encoding what it read). ``int8/token``: int8 with K, like V, one scale per token
(whole-row groups), as a tier with ``k_axis = "token"`` stores it (MLA: the defaults, already per
token): smaller than the default per-channel K on short blocks (SPEC 5.9), at the cost of KIVI's
outlier channels. ``ulp`` is no codec but the floor: see :func:`nudge_ulp`."""
DTYPES = ("bfloat16", "float32")
"""KV (and weight) dtypes of the quality part, each a run of every chain. bfloat16 is what engines
store; float32 shows a codec's own error apart from the engine's bf16 rounding (``ulp`` rows)."""
DTYPE_TAGS = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
LM_HEAD_SCALES = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)
ENTROPY_TARGET = 2.0
"""nats: the next-token distribution must be at least this peaked (the issue's bar)."""
KL_TARGET = 1e-3
AGREEMENT_TARGET = 99.0
TAIL_TOKENS = 5
"""Prompt tokens after the last full prefix block: computed on every scored step, so the prompt's
last position always reads the (modified) prefix."""
NS_ID = bytes(16)
PARTS = ("quality", "demotion", "zipf")


@dataclass(frozen=True, slots=True)
class DiskCodec:
    """A disk tier's precision setting in the store parts (StoreConfig ``disk_codec``,
    ``disk_k_axis``, ``disk_compression``)."""

    codec: str
    k_axis: str = "channel"
    compression: str = "none"


DISK_CODECS: dict[str, DiskCodec] = {
    "int8": DiskCodec("int8"),
    "int8/token": DiskCodec("int8", k_axis="token"),
    "int8+lz4": DiskCodec("int8", compression="lz4"),
}
"""The lossy disk tiers the store parts run next to a raw one (``--disk-codecs``): int8 with the
SPEC's default axes (K per channel), with K per token (``[tiers.disk] k_axis = "token"``: 1.94x
raw at 16-token blocks instead of 1.75x), and int8 followed by the lz4 stage."""
RAW_DISK = DiskCodec("raw")
DEMOTION_BATCH = 4
"""Blocks per put in the demotion fill: each put evicts as many host blocks to disk."""


def models(quick: bool) -> dict[str, ModelConfig]:
    """The two checkpoints: Llama-style GQA and DeepSeek-V2-style MLA (latent + RoPE key)."""
    if quick:
        common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      max_position_embeddings=1024)
        return {"llama-gqa": ModelConfig(num_kv_heads=2, head_dim=32, **common),
                "deepseek-v2-mla": ModelConfig(num_kv_heads=4, head_dim=48, attention="mla", kv_lora_rank=64,
                                               qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, **common)}
    common = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                  max_position_embeddings=2048)
    return {"llama-gqa": ModelConfig(num_kv_heads=2, head_dim=64, rope_theta=500000.0, **common),
            "deepseek-v2-mla": ModelConfig(num_kv_heads=8, head_dim=96, attention="mla", kv_lora_rank=256,
                                           qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, **common)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=None, help="tokens scored per chain (default 64; --quick 16)")
    parser.add_argument("--prefix-blocks", type=int, default=None,
                        help="full blocks of stored prefix (default 8; --quick 4)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="comma-separated weights and KV dtypes of the quality part, each a run of every "
                             "chain (of bfloat16, float16, float32; default bfloat16,float32)")
    parser.add_argument("--chains", default=",".join(CHAINS), help="comma-separated chains of " + ", ".join(CHAINS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated parts of " + ", ".join(PARTS) + " (default all)")
    parser.add_argument("--demotion-blocks", type=int, default=None,
                        help="blocks demoted per demotion run (default 64; --quick 12)")
    parser.add_argument("--demotion-host-blocks", type=int, default=8,
                        help="host tier of the demotion runs, in blocks (default 8)")
    parser.add_argument("--zipf-docs", type=int, default=None,
                        help="documents of the Zipf workload (default 64; --quick 24)")
    parser.add_argument("--zipf-doc-blocks", type=int, default=4, help="blocks per document (default 4)")
    parser.add_argument("--zipf-requests", type=int, default=None, help="requests (default 1000; --quick 120)")
    parser.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    parser.add_argument("--zipf-host-blocks", type=int, default=None,
                        help="host tier of the Zipf runs, in blocks (default 16; --quick 4)")
    parser.add_argument("--disk-codecs", default=",".join(DISK_CODECS),
                        help="comma-separated lossy disk tiers the demotion and Zipf parts run next to raw, of "
                             + ", ".join(DISK_CODECS) + " (default all)")
    parser.add_argument("--store-block-tokens", type=int, default=16,
                        help="tokens per block of the demotion and Zipf parts (default 16)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=10000.0,
                        help="modeled prefill speed for the Zipf TTFT (default 10000)")


@dataclass(slots=True)
class Scored:
    """Teacher-forced logits of one chain: ``[tokens, vocab]`` float32, and bytes per stored token."""

    logits: torch.Tensor
    bytes_per_token: float


class PrefixKV:
    """The prefix blocks of one prompt in an engine's page cache, read and written in the model's
    kvtier block layout."""

    def __init__(self, engine: Engine, prompt: Sequence[int], blocks: int) -> None:
        self.engine = engine
        hashes = engine._block_hashes(list(prompt))[:blocks]
        pages = [engine.allocator.page_of(h) for h in hashes]
        assert all(p is not None for p in pages), "the prefill left every prefix block in the page cache"
        self.pages: list[int] = pages  # type: ignore[assignment]
        self.mla = engine.model.config.is_mla
        self.layout = engine.model.kv_block_layout
        self.rope = engine.model.config.qk_rope_head_dim if self.mla else 0

    def read(self, page: int) -> torch.Tensor:
        """One block: MHA ``[L, 2, T, H, D]`` (vllm-flash), MLA ``[L, T, C]`` (mla-latent)."""
        layers = self.engine.kv_cache.layers
        return torch.stack([t[page] if self.mla else t[:, page] for t in layers]).contiguous()

    def write(self, page: int, block: torch.Tensor) -> None:
        for layer, t in enumerate(self.engine.kv_cache.layers):
            (t[page] if self.mla else t[:, page]).copy_(block[layer])

    def store_and_load(self, chain: Sequence[str]) -> float:
        """Run every prefix block through ``chain`` (encode a record, decode it, the next codec
        encodes that); write the result back. Returns the last record's bytes per token."""
        nbytes = 0
        for page in self.pages:
            block = self.read(page)
            for name in chain:
                if name == "ulp":
                    block = nudge_ulp(block, seed=page)
                    record = block.contiguous().view(torch.uint8).reshape(-1)  # its size: a raw payload
                    continue
                codec, _, axis = name.partition("/")
                # the parameters a tier with that k_axis re-encodes with (MLA: the defaults)
                quant = tier_quant(codec, axis or "channel", mla=self.mla)
                record = encode_block(block, ns_id=NS_ID, chain_hash=page.to_bytes(8, "little") + bytes(8),
                                      parent_hash=None, layout=self.layout, codec=codec, quant=quant,
                                      mla_rope_dim=self.rope)
                _, block = decode_block(record, layout=self.layout)
            nbytes += len(record)
            self.write(page, block)
        return nbytes / (len(self.pages) * self.engine.block_tokens)


def nudge_ulp(block: torch.Tensor, *, seed: int) -> torch.Tensor:
    """``block`` with each element moved, with probability 1/2, to a neighbouring value of its
    dtype (one unit in the last place, up or down in magnitude at random); zeros, infinities and
    NaNs are left alone.

    The smallest change a stored block of that dtype can carry: what it does to the logits is the
    floor under every lossy codec, the noise of the engine's own rounding (a recompute in another
    batch shape moves KV by about this much). A codec whose KL sits at this floor cannot be told
    from a perturbation of one ulp.
    """
    bits_dtype = {2: torch.int16, 4: torch.int32}[block.element_size()]
    gen = torch.Generator().manual_seed(seed)
    bits = block.contiguous().view(bits_dtype)
    magnitude = bits & torch.iinfo(bits_dtype).max  # sign bit cleared: the step is in magnitude
    finfo = torch.finfo(block.dtype)
    movable = (block != 0) & torch.isfinite(block) & (block.abs() < finfo.max)
    step = torch.randint(0, 2, block.shape, generator=gen, dtype=bits_dtype)  # 1/2 of the elements
    step *= torch.randint(0, 2, block.shape, generator=gen, dtype=bits_dtype) * 2 - 1  # +-1 ulp
    # magnitude 1 - 1 = 0 would be a zero (allowed: the neighbour of the smallest subnormal)
    moved = torch.where(movable, (magnitude + step) | (bits & ~torch.iinfo(bits_dtype).max), bits)
    return moved.view(block.dtype)


def _engine(model_dir: Path, dtype: torch.dtype, block_tokens: int, scale: float) -> Engine:
    engine = Engine(model_dir, dtype=dtype, block_tokens=block_tokens, num_pages=256, layerwise=False)
    head = engine.model.lm_head.weight
    with torch.no_grad():
        head.mul_(scale)
    return engine


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


def _score(engine: Engine, prompt: list[int], ref: list[int], chain: Sequence[str], blocks: int) -> Scored:
    """Prefill the prompt, put its prefix through ``chain``, then the teacher-forced logits."""
    engine.reset_prefix_cache()
    engine.generate([prompt], SamplingParams(max_tokens=1))
    per_token = PrefixKV(engine, prompt, blocks).store_and_load(chain)
    rows = []
    for k in range(len(ref)):
        out = engine.generate([prompt + ref[:k]], SamplingParams(max_tokens=1))[0]
        # the stored prefix is read, never recomputed: otherwise the chain would not be measured
        assert out.prefix_hit_tokens >= blocks * engine.block_tokens, "prefix recomputed"
        rows.append(out.first_logits)
    return Scored(torch.stack(rows).float(), per_token)


def _measure_model(model: str, cfg: ModelConfig, dtype_name: str, work: Path, args: argparse.Namespace,
                   chains: list[str], result: SuiteResult) -> None:
    dtype = getattr(torch, dtype_name)
    name = f"{model} {DTYPE_TAGS[dtype_name]}"
    tokens = args.tokens or (16 if args.quick else 64)
    blocks = args.prefix_blocks or (4 if args.quick else 8)
    bt = args.block_tokens
    model_dir = work / f"{model}-{dtype_name}"
    make_random_checkpoint(model_dir, cfg, seed=args.seed, dtype=dtype)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (blocks * bt + TAIL_TOKENS,), generator=gen).tolist()
    # The smallest LM head scale that makes the continuation peaked (random weights: near-uniform).
    engine, scale, entropy = None, 1.0, math.inf
    for scale in LM_HEAD_SCALES:
        engine = _engine(model_dir, dtype, bt, scale)
        out = engine.generate([prompt], SamplingParams(max_tokens=tokens, keep_logits=True))[0]
        entropy = float(_entropy(out.logits).mean())
        progress(f"precision: {name}: lm head x{scale:g}: mean entropy {entropy:.3f} nats")
        if entropy < ENTROPY_TARGET:
            break
        engine.close()
    assert engine is not None, "LM_HEAD_SCALES is not empty"
    ref = out.token_ids[:tokens]
    try:
        base = _score(engine, prompt, ref, CHAINS["raw"], blocks)
        p_ref = torch.log_softmax(base.logits.double(), -1)
        entropy = float(_entropy(base.logits).mean())
        result.rows.append(Row(name, "entropy", "nats", entropy, "target", ENTROPY_TARGET,
                               ENTROPY_TARGET / entropy if entropy else math.inf))
        result.rows.append(Row(name, "lm head scale", "x", scale, "checkpoint", 1.0, scale))
        std = float(base.logits.std())
        floor = None  # the ulp chain's KL, once measured: it runs first when asked for
        for chain in sorted(chains, key=lambda c: c != "ulp"):
            progress(f"precision: {name}: {chain}")
            got = base if chain == "raw" else _score(engine, prompt, ref, CHAINS[chain], blocks)
            agree = float((got.logits.argmax(-1) == base.logits.argmax(-1)).double().mean()) * 100.0
            logq = torch.log_softmax(got.logits.double(), -1)
            kl = float((p_ref.exp() * (p_ref - logq)).sum(-1).mean().clamp_min(0.0))
            if chain == "ulp":
                floor = kl
            err = float((got.logits - base.logits).abs().max())
            case = f"{name} {chain}"
            result.rows.append(Row(case, "top-1 agreement", "%", agree, "target", AGREEMENT_TARGET,
                                   agree / AGREEMENT_TARGET))
            result.rows.append(Row(case, "KL to raw", "nats", kl, "target", KL_TARGET,
                                   KL_TARGET / kl if kl > 0 else math.inf))
            if floor is not None and chain not in ("raw", "ulp"):
                # how far above the dtype's own one-ulp noise: ratio < 1 means above the floor
                result.rows.append(Row(case, "KL over the ulp floor", "nats", kl, "one-ulp nudge", floor,
                                       floor / kl if kl > 0 else math.inf))
            result.rows.append(Row(case, "max logit error", "logit", err, "raw logit std", std,
                                   std / err if err > 0 else math.inf))
            tpg = 2**30 / got.bytes_per_token
            raw_tpg = 2**30 / base.bytes_per_token
            result.rows.append(Row(case, "tokens per GiB", "tokens", tpg, "raw", raw_tpg, tpg / raw_tpg))
    finally:
        engine.close()


# --- the store parts: demotion throughput and a Zipf workload, raw vs int8 below host ----------


Block = tuple[bytes, bytes, bytes]
"""A raw block record of the store parts: (chain hash, header, payload)."""


def _kv(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Canonical ``[L, 2, H, T, D]`` bfloat16 KV-like values: Gaussian K with four channels x8
    (KIVI's outliers), V with log-normal per-token scales (as kvtier.bench.codecs.synthetic_kv,
    which imports this module)."""
    L, _, H, T, D = shape
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(L, H, T, D, generator=gen)
    k[..., sorted({c % D for c in (3, 17, 64, 100)})] *= 8.0
    v = torch.randn(L, H, T, D, generator=gen) * torch.exp(0.5 * torch.randn(L, H, T, 1, generator=gen))
    return torch.stack([k, v], 1).to(torch.bfloat16)


def _records(shape: tuple[int, ...], docs: int, blocks: int, seed: int, tag: bytes) -> list[list[Block]]:
    """``docs`` chains of ``blocks`` raw bfloat16 block records of canonical ``shape``. KV-like
    values (:func:`_kv`: outlier K channels, log-normal V scales); eight distinct tensors, whose
    payloads the blocks share (the codec's cost does not depend on which), each block with its
    own header (chain and parent hash)."""
    templates = []
    for i in range(8):
        record = encode_block(_kv(shape, seed + i), ns_id=NS_ID,
                              chain_hash=bytes(32), parent_hash=None, layout="canonical", codec="raw")
        head, payload = split_record(record)
        templates.append((head, bytes(payload)))
    out = []
    for d in range(docs):
        chain: list[Block] = []
        parent = None
        for b in range(blocks):
            h = hashlib.sha256(tag + d.to_bytes(4, "little") + b.to_bytes(4, "little")).digest()
            head, payload = templates[(d * blocks + b) % len(templates)]
            chain.append((h, encode_header(dataclasses.replace(head, chain_hash=h, parent_hash=parent)), payload))
            parent = h
        out.append(chain)
    return out


def _store_config(work: Path, codec: DiskCodec, host_bytes: int, disk_bytes: int) -> StoreConfig:
    """A store with ``host_bytes`` of host memory and ``disk_bytes`` of disk under ``work``, raw
    records re-encoded with ``codec`` on their way to disk. No commit scrub: every run skips it."""
    return StoreConfig(host_bytes=host_bytes, host_segment_bytes=host_bytes,
                       host_name_prefix=f"kvtier-bench-precision-{os.getpid()}", host_prefault=False,
                       host_pin=False, disk_path=str(work), disk_bytes=disk_bytes, disk_codec=codec.codec,
                       disk_k_axis=codec.k_axis, disk_compression=codec.compression, scrub_commits=False)


async def _put(store: TieredStore, blocks: Sequence[Block]) -> None:
    """reserve, copy each payload into its host slot, commit (the client's put, without sockets)."""
    res = await store.reserve(NS_ID, [h for h, _, _ in blocks], [len(p) for _, _, p in blocks])
    assert store.host is not None, "the bench's stores have a host tier"
    for (_, _, payload), slot in zip(blocks, res.slots):
        if slot is not None:
            store.host.view(slot)[:] = payload
    if res.lease_id:
        await store.commit(res.lease_id, [hd for _, hd, _ in blocks])


def _disk_tokens_per_gib(store: TieredStore, block_tokens: int) -> float:
    """Tokens the disk tier holds per GiB it is charged (headers and file alignment included)."""
    disk = store.gauges().tiers[Tier.DISK]
    return disk.blocks * block_tokens * 2**30 / disk.used_bytes if disk.used_bytes else math.nan


@dataclass(slots=True)
class Demotion:
    """One demotion fill: MiB/s of host blocks demoted, and the disk's tokens per GiB after it."""

    mib_s: float
    tokens_per_gib: float


async def _demotion_once(work: Path, codec: DiskCodec, blocks: list[Block], hold: int,
                         block_tokens: int) -> Demotion:
    """Fill a store whose host tier holds ``hold`` blocks with ``blocks``: the puts after the
    first ``hold`` each evict (demote) as many blocks to disk. Timed from the first evicting put."""
    size = len(blocks[0][2])
    shutil.rmtree(work, ignore_errors=True)
    cfg = _store_config(work, codec, hold * size, 2 * len(blocks) * size + (64 << 20))
    async with TieredStore(cfg) as store:
        for i in range(0, hold, DEMOTION_BATCH):
            await _put(store, blocks[i:min(hold, i + DEMOTION_BATCH)])
        before = store.counters.tiers[Tier.HOST].bytes_out
        start = time.perf_counter()
        for i in range(hold, len(blocks), DEMOTION_BATCH):
            await _put(store, blocks[i:i + DEMOTION_BATCH])
        seconds = time.perf_counter() - start
        demoted = store.counters.tiers[Tier.HOST].bytes_out - before
        assert store.gauges().tiers[Tier.DISK].blocks > 0, "the fill demoted blocks to disk"
        return Demotion(demoted / seconds / 2**20, _disk_tokens_per_gib(store, block_tokens))


def _demotion_rows(loop: asyncio.AbstractEventLoop, work: Path, args: argparse.Namespace, reps: int,
                   variants: list[str]) -> list[Row]:
    bt = args.store_block_tokens
    shape = (4, 2, 2, bt, 64) if args.quick else (32, 2, 8, bt, 128)
    count = args.demotion_blocks or (12 if args.quick else 64)
    hold = args.demotion_host_blocks
    blocks = _records(shape, 1, hold + count, args.seed, b"demotion")[0]
    size = len(blocks[0][2])
    case = f"demotion {size / 2**20:.3g} MiB blocks"
    rows: list[Row] = []
    for variant in variants:
        progress(f"precision: demotion of {count} blocks of {size / 2**20:.3g} MiB, host {hold} blocks, "
                 f"raw vs {variant}")
        runs: dict[str, list[Demotion]] = {"raw": [], variant: []}

        def once(name: str, codec: DiskCodec) -> float:
            got = loop.run_until_complete(_demotion_once(work / "tier", codec, blocks, hold, bt))
            runs[name].append(got)
            return got.mib_s

        # each variant against its own raw runs, alternating: the machine's drift hits both
        alternate(lambda: once(variant, DISK_CODECS[variant]), lambda: once("raw", RAW_DISK), repetitions=reps)
        raw_tpg = Samples([r.tokens_per_gib for r in runs["raw"]]).median
        tpg = Samples([r.tokens_per_gib for r in runs[variant]]).median
        # alternate()'s warm-up run of each is left out of the throughput
        rows.append(throughput_row(case, f"demotion throughput {variant}", "MiB/s",
                                   Samples([r.mib_s for r in runs[variant][1:]]),
                                   "raw demotion", Samples([r.mib_s for r in runs["raw"][1:]])))
        rows.append(Row(case, f"tokens per GiB of disk {variant}", "tokens", tpg, "raw", raw_tpg, tpg / raw_tpg))
    return rows


@dataclass(slots=True)
class ZipfRun:
    """One Zipf run: tokens requested and served from the store, per-request TTFT (ms), and the
    disk's tokens per GiB at the end."""

    requested: int
    hit: int
    ttft_ms: list[float]
    tokens_per_gib: float


def zipf_sequence(docs: int, requests: int, s: float, seed: int) -> list[int]:
    """``requests`` document indices, document k drawn with weight 1 / (k + 1)^s (seeded)."""
    rng = random.Random(seed)
    return rng.choices(range(docs), weights=[1.0 / (k + 1) ** s for k in range(docs)], k=requests)


async def _zipf_once(work: Path, codec: DiskCodec, docs: list[list[Block]], order: list[int],
                     host_blocks: int, disk_bytes: int, block_tokens: int, prefill_tps: float) -> ZipfRun:
    """The requests of ``order`` (document indices) against a fresh store with ``codec`` below
    host: load the stored prefix of each (acquire, decode every block, release), then put the
    blocks it lacked. TTFT = the load, measured, plus the missing tokens' modeled prefill."""
    size = len(docs[0][0][2])
    shutil.rmtree(work, ignore_errors=True)
    run = ZipfRun(0, 0, [], math.nan)
    async with TieredStore(_store_config(work, codec, host_blocks * size, disk_bytes)) as store:
        assert store.host is not None, "the bench's stores have a host tier"
        for d in order:
            chain = docs[d]
            start = time.perf_counter()
            acq = await store.acquire(NS_ID, [h for h, _, _ in chain])
            try:
                for block in acq.blocks:  # loaded as an engine loads it: the record decoded to bfloat16
                    record = b"".join([block.header, store.host.view(block.slot)[:block.slot.length]])
                    decode_block(record, verify=False)  # the store verified it
            finally:
                if acq.lease_id:
                    store.release(acq.lease_id)
            missing = len(chain) - len(acq.blocks)
            run.ttft_ms.append((time.perf_counter() - start + missing * block_tokens / prefill_tps) * 1e3)
            run.requested += len(chain) * block_tokens
            run.hit += len(acq.blocks) * block_tokens
            if missing:  # the engine computed them: saved for the next request
                await _put(store, chain[len(acq.blocks):])
        run.tokens_per_gib = _disk_tokens_per_gib(store, block_tokens)
    return run


def _zipf_rows(loop: asyncio.AbstractEventLoop, work: Path, args: argparse.Namespace, reps: int,
               variants: list[str]) -> list[Row]:
    bt = args.store_block_tokens
    shape = (2, 2, 2, bt, 64) if args.quick else (32, 2, 8, bt, 128)
    ndocs = args.zipf_docs or (24 if args.quick else 64)
    nreq = args.zipf_requests or (120 if args.quick else 1000)
    host_blocks = args.zipf_host_blocks or (4 if args.quick else 16)
    docs = _records(shape, ndocs, args.zipf_doc_blocks, args.seed, b"zipf")
    size = len(docs[0][0][2])
    total = ndocs * args.zipf_doc_blocks * size
    # Host and disk together hold about half the documents' raw bytes: the tiers decide the hit rate.
    disk_bytes = max(total // 2 - host_blocks * size, 4 * (size + 8192))
    order = zipf_sequence(ndocs, nreq, args.zipf_s, args.seed)
    case = f"zipf s={args.zipf_s:g} {ndocs}x{args.zipf_doc_blocks} blocks"
    rows: list[Row] = []
    for variant in variants:
        progress(f"precision: zipf s={args.zipf_s:g}: {nreq} requests over {ndocs} documents of "
                 f"{args.zipf_doc_blocks} x {size / 2**10:.0f} KiB blocks ({total / 2**20:.0f} MiB), host "
                 f"{host_blocks} blocks, disk {disk_bytes / 2**20:.0f} MiB, raw vs {variant}")
        runs: dict[str, list[ZipfRun]] = {"raw": [], variant: []}

        def once(name: str, codec: DiskCodec) -> float:
            got = loop.run_until_complete(_zipf_once(work / "tier", codec, docs, order, host_blocks, disk_bytes, bt,
                                                     args.prefill_tokens_per_s))
            runs[name].append(got)
            return sum(got.ttft_ms) / len(got.ttft_ms)

        # The hit rate is the same run after run (one request sequence, no clock in the policy);
        # the TTFT's measured part is not: alternating runs, medians, spreads.
        lossy_ttft, raw_ttft = alternate(lambda: once(variant, DISK_CODECS[variant]), lambda: once("raw", RAW_DISK),
                                         repetitions=reps, warmup=0)
        raw, lossy = runs["raw"][-1], runs[variant][-1]
        hit, raw_hit = 100.0 * lossy.hit / lossy.requested, 100.0 * raw.hit / raw.requested
        rows += [Row(case, f"hit rate {variant}", "%", hit, "raw", raw_hit, hit / raw_hit if raw_hit else math.inf),
                 latency_row(case, f"mean TTFT {variant}", "ms", lossy_ttft, "raw", raw_ttft),
                 Row(case, f"tokens per GiB of disk {variant}", "tokens", lossy.tokens_per_gib, "raw",
                     raw.tokens_per_gib, lossy.tokens_per_gib / raw.tokens_per_gib)]
    return rows


def _store_rows(args: argparse.Namespace, parts: list[str], variants: list[str], work: Path,
                result: SuiteResult) -> None:
    reps = args.repetitions or (1 if args.quick else 5)
    loop = asyncio.new_event_loop()
    try:
        if "demotion" in parts:
            result.rows.extend(_demotion_rows(loop, work / "demotion", args, reps, variants))
        if "zipf" in parts:
            result.rows.extend(_zipf_rows(loop, work / "zipf", args, max(1, reps // 2), variants))
    finally:
        loop.close()


def run(args: argparse.Namespace) -> SuiteResult:
    chains = [c.strip() for c in args.chains.split(",") if c.strip()]
    for c in chains:
        if c not in CHAINS:
            raise SystemExit(f"unknown chain {c!r}; choose from {', '.join(CHAINS)}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPE_TAGS:
            raise SystemExit(f"unknown dtype {d!r}; choose from {', '.join(DTYPE_TAGS)}")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            raise SystemExit(f"unknown part {p!r}; choose from {', '.join(PARTS)}")
    variants = [v.strip() for v in args.disk_codecs.split(",") if v.strip()]
    for v in variants:
        if v not in DISK_CODECS:
            raise SystemExit(f"unknown disk codec {v!r}; choose from {', '.join(DISK_CODECS)}")
    result = SuiteResult("precision")
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-precision-", dir="/tmp"))
    try:
        if "quality" in parts:
            for dtype_name in dtypes:
                for name, cfg in models(bool(args.quick)).items():
                    _measure_model(name, cfg, dtype_name, work, args, chains, result)
        _store_rows(args, parts, variants, work, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


__all__ = ["CHAINS", "DESCRIPTION", "DISK_CODECS", "DTYPES", "DiskCodec", "nudge_ulp", "PARTS", "PrefixKV", "add_arguments", "models", "run", "zipf_sequence"]
