"""Prefix reuse through a real kvtier daemon: exactness per codec, sharing, namespaces, failures.

Raw blocks are the engine's own KV bytes and the model's kernels are row-invariant (attention.py),
so logits after a loaded prefix are bit-identical to a full recompute; the tests assert equality.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.client import Client
from kvtier.connector import KVConnectorCore, namespace_for_checkpoint
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.checkpoint import make_random_checkpoint
from kvtier.engine.config import ModelConfig
from tests.kvtier.client.clientkit import short_timeout
from tests.kvtier.waitkit import ManualClock

TIMEOUT_S = 60.0  # daemon calls must succeed here: a bound no busy machine comes near

MHA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
MLA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=24, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024)
MOE = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=24, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                  topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0)
GEN64 = SamplingParams(max_tokens=64, keep_logits=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny GEMMs on a shared 2-core machine: a second BLAS thread only waits for the first.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def checkpoint(tmp_path: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    make_random_checkpoint(tmp_path / "model", cfg, seed=seed)
    return tmp_path / "model"


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) of the next-token distributions, one value per row."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("cfg, block_tokens", [(MHA, 16), (MLA, 16), (MHA, 32), (MOE, 16)],
                         ids=["mha", "mla", "mha-32", "mla-moe"])
def test_raw_hit_is_bit_exact(cfg: ModelConfig, block_tokens: int, kvtier_daemon, tmp_path: Path) -> None:
    model_dir = checkpoint(tmp_path, cfg)
    p = prompt(100, 1)  # 96 tokens in full blocks: all loadable, 4 tokens computed
    address = kvtier_daemon.address
    with Engine(model_dir, num_pages=64, block_tokens=block_tokens, kvtier_address=address, timeout_s=TIMEOUT_S) as cold:
        ref = cold.generate([p], GEN64)[0]  # a miss: full recompute, then saves the full blocks
        assert ref.prefix_hit_tokens == 0 and cold.stats.saved_blocks == 96 // block_tokens
    with Engine(model_dir, num_pages=64, block_tokens=block_tokens, kvtier_address=address, timeout_s=TIMEOUT_S) as warm:
        hit = warm.generate([p], GEN64)[0]
        assert hit.loaded_tokens == hit.prefix_hit_tokens == 96
        assert warm.stats.computed_tokens == 4 + 63
    assert torch.equal(hit.first_logits, ref.first_logits)
    assert torch.equal(hit.logits, ref.logits)
    assert hit.token_ids == ref.token_ids and len(ref.token_ids) == 64


@pytest.mark.parametrize("cfg, codec, min_agreement, max_mean_kl", [
    (MHA, "int8", 0.95, 1e-3), (MLA, "int8", 0.95, 1e-3), (MHA, "int4", 0.7, 2e-2),
], ids=["mha-int8", "mla-int8", "mha-int4"])
def test_quantized_hit_stays_close(cfg: ModelConfig, codec: str, min_agreement: float, max_mean_kl: float,
                                   kvtier_daemon, tmp_path: Path) -> None:
    model_dir = checkpoint(tmp_path, cfg)
    p = prompt(100, 2)
    with Engine(model_dir, num_pages=64, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S, codec=codec) as cold:
        ref = cold.generate([p], GEN64)[0]  # exact KV; stored quantized
    with Engine(model_dir, num_pages=64, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S, codec=codec) as warm:
        free = warm.generate([p], GEN64)[0]
        assert free.loaded_tokens == 96
        # Teacher-forced: position i sees the reference's first i tokens after the quantized prompt
        # KV (kept in the engine's pages since the load above), so each position is judged alone.
        forced = torch.stack([warm.prefill_logits(p + ref.token_ids[:i]) for i in range(64)])
        assert warm.stats.loaded_tokens == 96  # the prompt came from kvtier once, then from the pages
    agreement = (forced.argmax(-1) == torch.tensor(ref.token_ids)).double().mean().item()
    divergence = kl(ref.logits, forced)
    first_diff = next((i for i, (a, b) in enumerate(zip(free.token_ids, ref.token_ids)) if a != b), 64)
    print(f"\n{cfg.attention} {codec}: greedy agreement {agreement:.3f} over 64 tokens (teacher-forced); free-running "
          f"identical for {first_diff}/64 tokens; KL(raw||{codec}) first token {divergence[0]:.2e}, "
          f"mean {divergence.mean():.2e}, max {divergence.max():.2e}")
    assert agreement >= min_agreement
    assert divergence.mean() < max_mean_kl
    assert not torch.equal(free.first_logits, ref.first_logits)  # it really was quantized


def test_eight_requests_store_one_copy_of_the_system_prompt(kvtier_daemon, tmp_path: Path) -> None:
    model_dir = checkpoint(tmp_path, MHA)
    system = prompt(48, 3)  # 3 full blocks
    prompts = [system + prompt(20, 10 + i) for i in range(8)]  # + 1 full block and 4 tokens each
    params = SamplingParams(max_tokens=8)
    refs = [Engine(model_dir, num_pages=64).generate([q], params)[0] for q in prompts]
    with Engine(model_dir, num_pages=128, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.connector.stats
        assert (stats.saved_blocks, stats.skipped_blocks) == (3 + 8, 0)
        with Client.connect(kvtier_daemon.address, timeout_s=TIMEOUT_S) as client:
            assert client.stats()["blocks"] == 3 + 8
            assert client.lookup(engine.connector.ns.ns_id, engine.connector.block_hashes(system)).num_hits == 3
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert all(torch.equal(o.first_logits, r.first_logits) for o, r in zip(outs, refs))
    assert [o.prefix_hit_tokens for o in outs] == [0] + [48] * 7
    # Another engine: the first request loads its 4 blocks, the others share the system blocks
    # it loaded and load only their own fourth block.
    with Engine(model_dir, num_pages=128, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S) as engine:
        again = engine.generate(prompts, params)
        assert engine.stats.loaded_tokens == 64 + 7 * 16 and engine.connector.stats.loaded_blocks == 4 + 7
    assert [o.prefix_hit_tokens for o in again] == [64] * 8
    assert [o.token_ids for o in again] == [r.token_ids for r in refs]


def test_changed_weights_never_hit(kvtier_daemon, tmp_path: Path) -> None:
    model_dir = checkpoint(tmp_path, MHA)
    p = prompt(70, 4)
    with Engine(model_dir, num_pages=64, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S) as engine:
        before = engine.generate([p], SamplingParams(max_tokens=8))[0]
        old_ns = engine.connector.ns
    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.k_proj.weight"][0, 0] += 0.5  # one value of one tensor
    save_file(tensors, weights, metadata={"format": "pt"})
    with Engine(model_dir, num_pages=64, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S) as engine:
        assert engine.connector.ns.ns_id != old_ns.ns_id
        after = engine.generate([p], SamplingParams(max_tokens=8))[0]
    assert after.prefix_hit_tokens == 0
    recompute = Engine(model_dir, num_pages=64).generate([p], SamplingParams(max_tokens=8))[0]
    assert torch.equal(after.first_logits, recompute.first_logits)
    assert not torch.equal(after.first_logits, before.first_logits)
    with Client.connect(kvtier_daemon.address, timeout_s=TIMEOUT_S) as client:  # the old weights' blocks are still there
        assert client.lookup(old_ns.ns_id, old_ns.block_keys(p)).num_hits == 4


def test_daemon_stopped_or_paused_mid_run_degrades_to_recompute(kvtier_daemon, tmp_path: Path) -> None:
    model_dir = checkpoint(tmp_path, MHA)
    p, q = prompt(100, 5), prompt(60, 6)
    params = SamplingParams(max_tokens=10)
    alone = Engine(model_dir, num_pages=64)
    refs = alone.generate([p, q], params)
    # The engine's connector on a client whose hold-down a manual clock measures, with a timeout
    # no busy machine comes near; the calls meant to time out (the daemon SIGSTOPped) run under a
    # short one.
    clock = ManualClock()
    client = Client(kvtier_daemon.address, timeout_s=TIMEOUT_S, holddown_s=5.0, clock=clock, client_name="kvtier.connector")
    ns = namespace_for_checkpoint(model_dir, kv_dtype=torch.float32, block_tokens=16)
    connector = KVConnectorCore(ns, client=client, page_layout=alone.model.kv_block_layout)
    with client, connector, Engine(model_dir, num_pages=64, connector=connector, max_num_seqs=1) as engine:
        engine.generate([p], params)  # stores p's blocks
        engine.reset_prefix_cache()
        ids = [engine.add_request(p, params), engine.add_request(q, params)]
        outs = {o.request_id: o for o in engine.step()}  # p is admitted and loads its prefix
        kvtier_daemon.stop()
        while engine.has_unfinished():  # q is admitted after the daemon is gone: a miss
            outs.update((o.request_id, o) for o in engine.step())
        engine.flush()
        assert [outs[i].token_ids for i in ids] == [r.token_ids for r in refs]
        assert (outs[ids[0]].loaded_tokens, outs[ids[1]].loaded_tokens) == (96, 0)
        assert torch.equal(outs[ids[1]].first_logits, refs[1].first_logits)
        assert engine.connector.stats.failed_calls > 0
        # A silent daemon: the first call gives up after its timeout, the rest within the
        # hold-down at once, and the engine computes.
        kvtier_daemon.start()
        clock.advance(5.0)  # the hold-down the stopped daemon started is over: calls ask again
        kvtier_daemon.pause()
        try:
            engine.reset_prefix_cache()
            with short_timeout(client):
                out = engine.generate([q], params)[0]
        finally:
            kvtier_daemon.resume()
        assert out.token_ids == refs[1].token_ids and out.loaded_tokens == 0
        # Back to normal once the client's hold-down after a failure has passed: it stores and hits.
        clock.advance(5.0)
        engine.reset_prefix_cache()
        engine.generate([q], params)
        engine.reset_prefix_cache()
        assert engine.generate([q], params)[0].loaded_tokens == 48


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_raw_hit_on_cuda(kvtier_daemon, tmp_path: Path) -> None:
    # GPU kernels need not be row-invariant, so the bound here is the 1e-5 relative.
    model_dir = checkpoint(tmp_path, MHA)
    p = prompt(100, 7)
    with Engine(model_dir, device="cuda", num_pages=64, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S) as cold:
        ref = cold.generate([p], GEN64)[0]
    with Engine(model_dir, device="cuda", num_pages=64, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S) as warm:
        hit = warm.generate([p], GEN64)[0]
    assert hit.loaded_tokens == 96
    scale = ref.first_logits.abs().max().item()
    torch.testing.assert_close(hit.first_logits, ref.first_logits, rtol=1e-5, atol=1e-5 * scale)
    assert hit.token_ids == ref.token_ids
