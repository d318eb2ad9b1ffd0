"""`kvtier bench ttft`: time to first token on a prefix hit vs a full prefill, in the same run.

A prompt of ``L`` tokens whose first ``L - suffix`` tokens are stored in a real daemon (a
``kvtier serve`` subprocess on a unix socket: loads come through its shared memory, host tier
only) is answered twice, alternately: once loading the stored prefix and computing the suffix
(kvtier), once computing every token (baseline). Both sides run one forward pass over their
tokens and stop at the first token. ``ratio`` = prefill / hit: how many times sooner the first
token comes on a hit.

Two suffixes by default, each a row set of its own:
  * 16 tokens, one block: the prompt was seen whole before (a retry, a shared document asked the
    same question, a regenerated answer). An engine always computes at least the prompt's last
    token to get logits, and a block-granular cache then recomputes the last block: vLLM with
    16-token blocks computes the last 16 tokens of a fully cached 4096-token prompt.
  * 256 tokens: a new turn (question) after a stored context; the hit computes the turn.

Rows, per prompt length:
  * ``engine L (S stored)`` TTFT: the reference engine loading the prefix through its connector
    (every hit starts from empty pages and a fresh suffix, so it loads exactly S tokens), next
    to the same engine and weights without kvtier computing all L tokens.
  * ``engine L (S stored)`` TTFT vs resident: the same hit next to a hit on the engine's own
    pages (the prefix already resident, nothing loaded): the cost of the load itself.
  * ``engine L (S stored)`` ceiling: that resident-prefix hit next to the full prefill: the
    speed-up a KV store that loads in zero time would give (computing the L - S suffix tokens
    over the whole context is left either way), so the TTFT ratio is read against it.
  * ``hf L (S stored)`` TTFT and TTFT vs resident: HF transformers (``AutoModelForCausalLM``,
    SDPA) with the prefix loaded into a ``DynamicCache`` by :mod:`kvtier.connector.hf_cache`,
    next to HF computing all L tokens, and next to HF continuing a cache already in memory.

  * ``engine L (L/2 stored, partial hit)`` TTFT layer-wise vs load-then-compute: half the
    prompt stored, the other half computed; the reference engine loading the stored half layer
    by layer while the suffix's layers compute (``Engine(layerwise=True)``, its default), next to
    the same engine loading every block before the forward (``layerwise=False``). One row per
    length, in the same run; the two give ``torch.equal`` logits (checked).

``--device cuda`` runs the reference engine (model and paged KV) on the GPU: its loads and saves
then go through pinned staging and the connector's copy streams. HF rows stay on the CPU.

The prefixes are stored by the reference engine and loaded by HF as well: one namespace per
checkpoint, so HF reuses the engine's KV ("prefill once, decode anywhere"). The model is a random
checkpoint (``make_random_checkpoint``, fixed seed) unless ``--model`` names one. TTFT is the
caller's view: hashing the prompt, the lookup and load, the forward pass, the first token.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvtier.bench.daemon import BenchDaemon
from kvtier.bench.report import Row, SuiteResult, alternate, latency_row, progress
from kvtier.connector import KVConnectorCore, namespace_for_checkpoint
from kvtier.connector.hf_cache import cache_argument, load_prefix, save_prefix
from kvtier.engine.checkpoint import load_config, make_random_checkpoint
from kvtier.engine.config import ModelConfig
from kvtier.engine.engine import Engine, Output
from kvtier.engine.sampler import SamplingParams

DESCRIPTION = "time to first token on a prefix hit vs full prefill (reference engine and HF)"
MIB = 1 << 20
BENCH_MODEL = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                          num_kv_heads=4, head_dim=64, rope_theta=500000.0, max_position_embeddings=8448)
QUICK_MODEL = ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=1024)
ONE = SamplingParams(max_tokens=1)
HF_K, PROFILE_K = -1, -2  # suffix numbers of HF's prompts and of the profiled engine hit (engine hits count from 0)
Fn = Callable[[], float]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="an HF Llama-family checkpoint dir (default: a random one)")
    parser.add_argument("--layers", type=int, default=None, help="layers of the random model (default 8; --quick 2)")
    parser.add_argument("--lengths", default=None, help="prompt lengths (default 1024,2048,4096,8192; --quick 256,512)")
    parser.add_argument("--suffix", default=None,
                        help="tokens computed on a hit, one row set each (default 16,256; --quick 64)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV dtype (default float32: this CPU has no bf16 GEMM)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--engines", choices=("both", "engine", "hf"), default="both", help="which engines to run")
    parser.add_argument("--device", default="cpu",
                        help="torch device of the reference engine (default cpu; cuda: model and KV on the GPU)")
    parser.add_argument("--profile", metavar="PREFIX", default=None,
                        help="cProfile one hit per engine at the longest length into PREFIX-<engine>-s<suffix>.prof "
                             "(top functions on stderr)")


def run(args: argparse.Namespace) -> SuiteResult:
    reps = args.repetitions or (2 if args.quick else 3)
    lengths = [int(x) for x in (args.lengths or ("256,512" if args.quick else "1024,2048,4096,8192")).split(",")]
    suffixes = [int(x) for x in (args.suffix or ("64" if args.quick else "16,256")).split(",")]
    if not all(0 < s < min(lengths) for s in suffixes) or any(n % 16 for n in lengths):
        raise ValueError("ttft: every --suffix must be below every length, and lengths multiples of 16")
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-ttft-", dir="/tmp"))
    try:
        model_dir = Path(args.model) if args.model else _random_model(work, args, dtype)
        cfg = load_config(model_dir)
        if max(lengths) >= cfg.max_position_embeddings:
            raise ValueError(f"ttft: the model has {cfg.max_position_embeddings} positions, < {max(lengths) + 1}")
        device = getattr(args, "device", "cpu")
        plans = [_Plan(model_dir, lengths, s, reps, dtype, cfg.vocab_size, args.profile, device) for s in suffixes]
        ns = namespace_for_checkpoint(model_dir, kv_dtype=dtype)
        # Every prefix, plus the suffix blocks each engine hit saves after its first token, plus
        # the partial hits' halves (stored, and saved by every hit).
        blocks = (sum(n + 4 * reps * s for n in lengths for s in suffixes) + sum(n + 2 * reps * n for n in lengths)) \
            // ns.block_tokens
        stored = blocks * ns.block_payload_bytes()
        flags = ["--rest", "off", "--host-bytes", str(max(256 * MIB, 2 * stored)), "--disk-bytes", "0"]
        daemon = BenchDaemon(work, flags, suite="ttft")
        daemon.start()
        try:
            result = SuiteResult("ttft")
            # HF first: its prefill is the faster one, so it computes and stores the prefixes,
            # and the engine's hits load HF's KV.
            for plan in plans:
                if args.engines in ("both", "hf"):
                    result.rows += _hf_rows(plan, daemon.address)
                if args.engines in ("both", "engine"):
                    result.rows += _engine_rows(plan, daemon.address)
            if args.engines in ("both", "engine"):
                result.rows += _partial_rows(plans[0], daemon.address)
            return result
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What every engine runs: the same prompts (one prefix per length, numbered suffixes)."""

    model_dir: Path
    lengths: list[int]     # prompt lengths
    suffix: int            # tokens after the stored prefix: what a hit computes
    reps: int              # repetitions per figure
    dtype: torch.dtype
    vocab: int
    profile: str | None    # cProfile output prefix, or None
    device: str = "cpu"    # the reference engine's device
    block_tokens: int = 16  # the engine's default page, and the namespace's block

    def tokens(self, n: int, seed: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def prefix(self, length: int) -> list[int]:
        return self.tokens(length - self.suffix, seed=length)

    def prompt(self, length: int, k: int) -> list[int]:
        """The prefix and suffix number ``k``. Engine hits take a fresh ``k`` each: a hit then never
        finds blocks an earlier hit saved past the prefix, so every hit loads exactly the prefix."""
        return self.prefix(length) + self.tokens(self.suffix, seed=(length << 20) + k)

    def case(self, engine: str, length: int) -> str:
        return f"{engine} {length} ({length - self.suffix} stored)"


def _random_model(work: Path, args: argparse.Namespace, dtype: torch.dtype) -> Path:
    cfg = QUICK_MODEL if args.quick else BENCH_MODEL
    if args.layers:
        cfg = replace(cfg, num_layers=args.layers)
    progress(f"ttft: random checkpoint: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads "
             f"{cfg.num_heads}/{cfg.num_kv_heads}, vocab {cfg.vocab_size}, {str(dtype).removeprefix('torch.')}")
    make_random_checkpoint(work / "model", cfg, seed=0, dtype=dtype)
    return work / "model"


# --- the reference engine ------------------------------------------------------------------------


def _engine_rows(plan: _Plan, address: str) -> list[Row]:
    kw = dict(dtype=plan.dtype, max_step_tokens=max(plan.lengths), device=plan.device)
    rows: list[Row] = []
    with Engine(plan.model_dir, kvtier_address=address, **kw) as kv, Engine(plan.model_dir, **kw) as plain:
        for length in plan.lengths:
            stored = length - plan.suffix
            prefix = plan.prefix(length)
            assert kv.connector is not None
            if kv.connector.lookup(kv.connector.block_hashes(prefix)) < stored // plan.block_tokens:
                progress(f"ttft: engine {length}: computing and storing the {stored}-token prefix")
                kv.generate([prefix], ONE)
            calls = {"hit": 0, "full": 0, "resident": 1 << 16}
            logits: dict[str, list[torch.Tensor]] = {"hit": [], "full": []}

            def timed(engine: Engine, role: str) -> tuple[float, Output]:
                k, calls[role] = calls[role], calls[role] + 1
                return _engine_ttft(engine, plan.prompt(length, k))

            def hit() -> float:
                kv.reset_prefix_cache()  # forget the pages: the prefix must come from kvtier
                t, out = timed(kv, "hit")
                _expect(out.loaded_tokens == stored, f"engine hit loaded {out.loaded_tokens} of {stored} tokens")
                logits["hit"].append(out.first_logits)
                return t

            def full() -> float:  # the k-th full prefill answers the k-th hit's prompt: comparable logits
                plain.reset_prefix_cache()
                t, out = timed(plain, "full")
                _expect(out.prefix_hit_tokens == 0, f"engine prefill reused {out.prefix_hit_tokens} tokens")
                logits["full"].append(out.first_logits)
                return t

            def resident() -> float:  # the hit before it left the prefix in the engine's pages
                t, out = timed(kv, "resident")
                _expect(out.loaded_tokens == 0 and out.prefix_hit_tokens == stored,
                        f"resident run: {out.prefix_hit_tokens} reused, {out.loaded_tokens} loaded of {stored}")
                return t

            _two_rows(rows, plan, "engine", length, hit, full, "engine prefill (no kvtier)", resident,
                      "engine, prefix in its own pages", logits)
        if plan.profile:
            kv.reset_prefix_cache()
            _profiled(f"{plan.profile}-engine-s{plan.suffix}.prof",
                      lambda: _engine_ttft(kv, plan.prompt(max(plan.lengths), PROFILE_K)))
    return rows


def _partial_rows(plan: _Plan, address: str) -> list[Row]:
    """Half of each prompt stored: layer-wise overlapped load vs load-then-compute, alternating."""
    kw = dict(dtype=plan.dtype, max_step_tokens=max(plan.lengths), device=plan.device, kvtier_address=address)
    rows: list[Row] = []
    with Engine(plan.model_dir, layerwise=True, **kw) as layered, Engine(plan.model_dir, layerwise=False, **kw) as whole:
        for length in plan.lengths:
            stored = length // 2
            prefix = plan.tokens(stored, seed=length + (1 << 30))
            assert layered.connector is not None
            if layered.connector.lookup(layered.connector.block_hashes(prefix)) < stored // plan.block_tokens:
                progress(f"ttft: engine {length}: computing and storing the {stored}-token half for partial hits")
                layered.generate([prefix], ONE)
            calls = {"layered": 0, "whole": 0}
            logits: dict[str, list[torch.Tensor]] = {"layered": [], "whole": []}

            def timed(engine: Engine, role: str) -> float:
                # the k-th hit of each side answers the same fresh prompt: comparable logits
                k, calls[role] = calls[role], calls[role] + 1
                engine.reset_prefix_cache()  # the stored half must come from kvtier
                t, out = _engine_ttft(engine, prefix + plan.tokens(length - stored, seed=(length << 21) + (1 << 40) + k))
                _expect(out.loaded_tokens == stored, f"partial hit loaded {out.loaded_tokens} of {stored} tokens")
                logits[role].append(out.first_logits)
                return t

            # The whole-block side's hit saves the suffix it computed; the layer-wise side's hit
            # of the same prompt then finds it stored too. Delete what each hit saved past the half.
            def forget(engine: Engine, role: str) -> None:
                assert engine.connector is not None
                k = calls[role] - 1
                prompt = prefix + plan.tokens(length - stored, seed=(length << 21) + (1 << 40) + k)
                engine.connector.client.delete(engine.connector.ns.ns_id,
                                               engine.connector.block_hashes(prompt)[stored // plan.block_tokens:])

            def layer_hit() -> float:
                t = timed(layered, "layered")
                forget(layered, "layered")
                return t

            def whole_hit() -> float:
                t = timed(whole, "whole")
                forget(whole, "whole")
                return t

            kv_s, base_s = alternate(layer_hit, whole_hit, repetitions=plan.reps, warmup=0)
            case = f"engine {length} ({stored} stored, partial hit)"
            rows.append(latency_row(case, "TTFT layer-wise vs load-then-compute", "ms", kv_s,
                                    "engine, whole blocks loaded before the forward", base_s))
            _expect(all(torch.equal(a, b) for a, b in zip(logits["layered"], logits["whole"])),
                    "layer-wise and whole-block partial hits gave different logits")
            r = rows[-1]
            progress(f"ttft: {r.case} {r.metric}: {r.kvtier:.1f} ms vs {r.baseline:.1f} ms -> {r.ratio:.2f}x")
    return rows


def _engine_ttft(engine: Engine, prompt: list[int]) -> tuple[float, Output]:
    """Milliseconds from handing the prompt over (hashing included) to its first token."""
    t0 = time.perf_counter()
    engine.add_request(prompt, ONE)
    done: list[Output] = []
    while not done:
        done = engine.step()
    t = (time.perf_counter() - t0) * 1e3
    engine.flush()  # the hit's background save of its suffix blocks, outside the timed region
    return t, done[0]


# --- HF transformers -----------------------------------------------------------------------------


def _hf_rows(plan: _Plan, address: str) -> list[Row]:
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries the bench's own progress lines
    model = AutoModelForCausalLM.from_pretrained(plan.model_dir, dtype=plan.dtype).eval()
    arg = cache_argument(model)
    ns = namespace_for_checkpoint(plan.model_dir, kv_dtype=plan.dtype)
    rows: list[Row] = []

    def forward(ids: list[int], cache: object = None) -> tuple[torch.Tensor, object]:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{arg: cache})
        int(out.logits[0, -1].argmax())  # the first token
        return out.logits[0, -1], (out.cache if hasattr(out, "cache") else out.past_key_values)

    with KVConnectorCore(ns, address=address) as core:
        for length in plan.lengths:
            prefix, stored = plan.prefix(length), length - plan.suffix
            prompt = plan.prompt(length, HF_K)  # HF saves nothing, so one prompt serves every call
            if core.lookup(core.block_hashes(prefix)) < stored // plan.block_tokens:
                progress(f"ttft: hf {length}: computing and storing the {stored}-token prefix")
                save_prefix(core, prefix, forward(prefix)[1])
            kept, n = load_prefix(core, prompt, dtype=plan.dtype, config=model.config)
            _expect(kept is not None and n == stored, f"hf loaded {n} of {stored} tokens")
            layers = [(layer.keys, layer.values) for layer in kept.layers]
            logits: dict[str, list[torch.Tensor]] = {"hit": [], "full": []}

            def hit() -> float:
                t0 = time.perf_counter()
                cache, n = load_prefix(core, prompt, dtype=plan.dtype, config=model.config)
                out = forward(prompt[n:], cache)[0]
                t = (time.perf_counter() - t0) * 1e3
                _expect(n == stored, f"hf loaded {n} of {stored} tokens")
                logits["hit"].append(out)
                return t

            def full() -> float:
                t0 = time.perf_counter()
                out = forward(prompt)[0]
                t = (time.perf_counter() - t0) * 1e3
                logits["full"].append(out)
                return t

            def resident() -> float:
                t0 = time.perf_counter()
                forward(prompt[stored:], DynamicCache(ddp_cache_data=layers, config=model.config))
                return (time.perf_counter() - t0) * 1e3

            _two_rows(rows, plan, "hf", length, hit, full, "HF prefill (no kvtier)", resident,
                      "HF, DynamicCache in memory", logits)
            if plan.profile and length == max(plan.lengths):
                _profiled(f"{plan.profile}-hf-s{plan.suffix}.prof", hit)
    return rows


# --- reporting -----------------------------------------------------------------------------------


def _two_rows(rows: list[Row], plan: _Plan, engine: str, length: int, hit: Fn, full: Fn, full_name: str,
              resident: Fn, resident_name: str, logits: dict[str, list[torch.Tensor]]) -> None:
    """Hit vs full prefill, hit vs resident prefix, then resident prefix vs full prefill (the
    ceiling: what a cache that loads in zero time would give), each alternating; appended to
    ``rows``."""
    kv_s, base_s = alternate(hit, full, repetitions=plan.reps, warmup=0)
    rows.append(latency_row(plan.case(engine, length), "TTFT", "ms", kv_s, full_name, base_s))
    worst = max(float((h - f).abs().max() / f.abs().max()) for h, f in zip(logits["hit"], logits["full"]))
    kv_s, base_s = alternate(hit, resident, repetitions=plan.reps, warmup=0)
    rows.append(latency_row(plan.case(engine, length), "TTFT vs resident", "ms", kv_s, resident_name, base_s))
    res_s, base_s = alternate(resident, full, repetitions=plan.reps, warmup=0)
    rows.append(latency_row(plan.case(engine, length), "ceiling: resident vs prefill", "ms", res_s, full_name,
                            base_s))
    progress(f"ttft: {engine} {length}: next-token logits of hit vs prefill differ by <= {worst:.1e} (relative)")
    for r in rows[-3:]:
        progress(f"ttft: {r.case} {r.metric}: {r.kvtier:.1f} ms vs {r.baseline_name} {r.baseline:.1f} ms "
                 f"-> {r.ratio:.2f}x")


def _expect(ok: bool, what: str) -> None:
    """A figure is only meaningful if each run did what its row says (a hit loaded the prefix)."""
    if not ok:
        raise RuntimeError(f"ttft: {what}")


def _profiled(path: str, fn: Callable[[], object]) -> None:
    prof = cProfile.Profile()
    prof.runcall(fn)
    prof.dump_stats(path)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    progress(f"ttft: profile of one hit -> {path}\n{out.getvalue()}")


__all__ = ["DESCRIPTION", "add_arguments", "run"]
