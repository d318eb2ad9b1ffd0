"""Prefill once, decode anywhere: the reference engine and HF transformers share prefixes through kvtier.

Both engines keep K after RoPE (rotate-half pairing, the same float32 operations), the same
checkpoint gives both the same namespace, and blocks travel in a layout each converts from. The
K/V one engine stores are therefore the K/V the other would compute, up to float32 rounding of
the projections (different GEMM kernels: not bit-identical), and the next-token logits after a
loaded prefix match the loading engine's own recompute to ≤ 1e-4 relative (seen: ~1e-7).

At every block size both engines (and vLLM) hash in units of the block
(:func:`kvtier.connector.namespace.hash_tokens_for`), so they meet in one namespace: every full
block one stores is a hit for the other, and the K/V it loads are bit-for-bit the K/V stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.connector import KVConnectorCore, namespace_for_checkpoint
from kvtier.connector.hf_cache import cache_argument, load_prefix, save_prefix
from kvtier.engine.checkpoint import make_random_checkpoint
from kvtier.engine.config import ModelConfig
from kvtier.engine.engine import Engine
from kvtier.engine.sampler import SamplingParams
from kvtier_hf import HFPrefixCache

transformers = pytest.importorskip("transformers")

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512)
REL = 1e-4
PAGES = 64
TIMEOUT_S = 60.0  # daemon calls must succeed here: a bound no busy machine comes near


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-x")
    make_random_checkpoint(path, TINY, seed=3, dtype=torch.float32)
    return path


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist()


def _hf(model: torch.nn.Module, ids: list[int], cache=None) -> tuple[torch.Tensor, object]:
    """Last-position logits and the cache after one HF forward pass."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
    return out.logits[0, -1], (out.cache if hasattr(out, "cache") else out.past_key_values)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_engine_saves_hf_loads(checkpoint: Path, hf_model, kvtier_daemon) -> None:
    ids = _prompt(90, seed=11)
    with Engine(checkpoint, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S, num_pages=PAGES) as engine:
        engine.generate([ids], SamplingParams(max_tokens=1))
        assert engine.stats.saved_blocks == 5  # 80 of 90 tokens are full blocks
    ns = namespace_for_checkpoint(checkpoint, kv_dtype=torch.float32)
    with KVConnectorCore(ns, address=kvtier_daemon.address, timeout_s=TIMEOUT_S) as core:
        cache, n = load_prefix(core, ids, dtype=torch.float32, config=hf_model.config)
    assert n == 80 and cache is not None
    want_logits, want_cache = _hf(hf_model, ids)
    # The engine's K/V are HF's own up to float32 rounding of the projections.
    for got, want in zip(cache.layers, want_cache.layers):
        assert _rel(got.keys, want.keys[:, :, :n]) < 1e-5 and _rel(got.values, want.values[:, :, :n]) < 1e-5
    logits, _ = _hf(hf_model, ids[n:], cache)
    assert _rel(logits, want_logits) <= REL


def test_hf_saves_engine_loads(checkpoint: Path, hf_model, kvtier_daemon) -> None:
    ids = _prompt(70, seed=12)
    ns = namespace_for_checkpoint(checkpoint, kv_dtype=torch.float32)
    with KVConnectorCore(ns, address=kvtier_daemon.address, timeout_s=TIMEOUT_S) as core:
        assert save_prefix(core, ids, _hf(hf_model, ids)[1]) == 4
    with Engine(checkpoint, num_pages=PAGES) as alone:
        recompute = alone.generate([ids], SamplingParams(max_tokens=8))[0]
    with Engine(checkpoint, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S, num_pages=PAGES) as engine:
        hit = engine.generate([ids], SamplingParams(max_tokens=8))[0]
        assert engine.stats.saved_blocks == 0  # nothing new: HF stored every full block
    assert hit.loaded_tokens == 64 and recompute.loaded_tokens == 0
    assert _rel(hit.first_logits, recompute.first_logits) <= REL
    assert hit.token_ids == recompute.token_ids


def _engine_kv(engine: Engine, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K and V ``[H, n*T, D]`` of the full blocks of ``ids`` in the engine's pages."""
    assert engine.connector is not None
    pages = [engine.allocator.page_of(h) for h in engine.connector.block_hashes(ids)]
    assert None not in pages, "every full block of the prompt is in a page"
    out = []
    for layer in engine.kv_cache.layers:  # [2, P, T, H, D] (vllm-flash)
        kv = layer[:, pages].flatten(1, 2).transpose(1, 2)  # [2, H, n*T, D]
        out.append((kv[0].clone(), kv[1].clone()))
    return out


def _assert_same_kv(cache, engine_kv: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
    assert len(cache.layers) == len(engine_kv)
    for layer, (k, v) in zip(cache.layers, engine_kv):
        assert torch.equal(layer.keys[0, :, :n], k[:, :n]) and torch.equal(layer.values[0, :, :n], v[:, :n])


@pytest.mark.parametrize("block_tokens", [16, 32, 64])
def test_every_full_block_crosses_at_any_block_size(block_tokens: int, checkpoint: Path, hf_model,
                                                    kvtier_daemon_module) -> None:
    address = kvtier_daemon_module.address
    full = 197 // block_tokens  # 197 tokens: the last one is computed whatever the block size
    n = full * block_tokens

    # The engine stores; HF loads every full block, bit-for-bit the engine's K/V.
    ids = _prompt(197, seed=100 + block_tokens)
    with Engine(checkpoint, kvtier_address=address, timeout_s=TIMEOUT_S, num_pages=PAGES, block_tokens=block_tokens) as engine:
        engine.generate([ids], SamplingParams(max_tokens=1))
        assert engine.stats.saved_blocks == full
        stored = _engine_kv(engine, ids)
    with HFPrefixCache.for_model(hf_model, checkpoint, address=address, block_tokens=block_tokens,
                                 timeout_s=TIMEOUT_S) as kv:
        cache, loaded = kv.load(ids)
        assert loaded == n and cache is not None
        _assert_same_kv(cache, stored, n)
        out = kv.prefill(ids, logits_to_keep=1)
        assert (out.reused_tokens, out.saved_blocks) == (n, 0)  # nothing new: the engine stored it all
    assert _rel(out.logits[0, -1], _hf(hf_model, ids)[0]) <= REL

    # And back: HF stores; the engine loads every full block, bit-for-bit HF's K/V.
    ids = _prompt(197, seed=200 + block_tokens)
    with HFPrefixCache.for_model(hf_model, checkpoint, address=address, block_tokens=block_tokens,
                                 timeout_s=TIMEOUT_S) as kv:
        out = kv.prefill(ids, logits_to_keep=1)
        assert (out.reused_tokens, out.saved_blocks) == (0, full)
    with Engine(checkpoint, num_pages=PAGES, block_tokens=block_tokens) as alone:
        recompute = alone.generate([ids], SamplingParams(max_tokens=1))[0]
    with Engine(checkpoint, kvtier_address=address, timeout_s=TIMEOUT_S, num_pages=PAGES, block_tokens=block_tokens) as engine:
        hit = engine.generate([ids], SamplingParams(max_tokens=1))[0]
        assert hit.loaded_tokens == n and engine.stats.saved_blocks == 0
        _assert_same_kv(out.cache, _engine_kv(engine, ids), n)
    assert _rel(hit.first_logits, recompute.first_logits) <= REL
