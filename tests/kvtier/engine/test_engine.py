"""Engine without kvtier: batching, chunked prefill, in-engine prefix sharing, sampling, limits.

Every comparison of logits here is bit-exact: the model's attention and GEMMs are row-invariant
on CPU (attention.py), so a token's logits do not depend on batch, chunking or reuse.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvtier_protocol.errors import CapacityError, InvalidRequest

from kvtier.engine import Engine, SamplingParams
from kvtier.engine.checkpoint import make_random_checkpoint
from kvtier.engine.config import ModelConfig

MHA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
MLA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=24, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024)
GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny GEMMs on a shared 2-core machine: a second BLAS thread only waits for the first.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def mha_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mha")
    make_random_checkpoint(path, MHA, seed=1)
    return path


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mla")
    make_random_checkpoint(path, MLA, seed=2)
    return path


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(model_dir: Path, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    """Each prompt run by itself on a fresh engine: the reference for batched runs."""
    return [Engine(model_dir, num_pages=64).generate([p], params)[0] for p in prompts]


def assert_same(outs: list, refs: list) -> None:
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        assert torch.equal(out.first_logits, ref.first_logits)


@pytest.mark.parametrize("model", ["mha", "mla"])
def test_a_batch_of_different_lengths_equals_each_alone(model: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(f"{model}_dir")
    prompts = [prompt(n, seed) for seed, n in enumerate((5, 23, 40, 70))]
    engine = Engine(model_dir, num_pages=64)
    outs = engine.generate(prompts, GREEDY)
    assert_same(outs, alone(model_dir, prompts))
    assert [len(o.token_ids) for o in outs] == [12] * 4 and {o.finish_reason for o in outs} == {"length"}
    assert engine.stats.prompt_tokens == 138 and engine.stats.requests == 4
    assert engine.allocator.num_free == 64  # every page back


def test_chunked_prefill_gives_the_same_logits(mha_dir: Path) -> None:
    prompts = [prompt(61, 10), prompt(33, 11)]
    whole = Engine(mha_dir, num_pages=64).generate(prompts, GREEDY)
    chunked = Engine(mha_dir, num_pages=64, max_step_tokens=7)
    assert_same(chunked.generate(prompts, GREEDY), whole)
    assert chunked.stats.steps > 94 // 7


def test_eight_requests_share_one_copy_of_the_system_prompt(mha_dir: Path) -> None:
    system = prompt(48, 20)  # three full blocks
    prompts = [system + prompt(10 + i, 30 + i) for i in range(8)]
    engine = Engine(mha_dir, num_pages=128)
    outs = engine.generate(prompts, GREEDY)
    assert_same(outs, alone(mha_dir, prompts))
    assert [o.prefix_hit_tokens for o in outs] == [0] + [48] * 7
    assert engine.stats.shared_tokens == 7 * 48
    # The system prompt went through the model once; every other prompt token once.
    new_tokens = sum(len(p) for p in prompts) - 7 * 48
    assert engine.stats.computed_tokens == new_tokens + 8 * (GREEDY.max_tokens - 1)


def test_a_repeated_prompt_reuses_its_pages(mha_dir: Path) -> None:
    engine = Engine(mha_dir, num_pages=64)
    p = prompt(50, 40)
    first = engine.prefill_logits(p)
    assert torch.equal(engine.prefill_logits(p), first)
    assert engine.stats.shared_tokens == 48  # 3 full blocks; the last token is always computed
    engine.reset_prefix_cache()
    assert torch.equal(engine.prefill_logits(p), first)
    assert engine.stats.shared_tokens == 48


def test_seeded_sampling_does_not_depend_on_the_batch(mha_dir: Path) -> None:
    p = prompt(30, 50)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5)
    engine = Engine(mha_dir, num_pages=64)
    (ref,) = engine.generate([p], params)
    batch = engine.generate([prompt(9, 51), p, prompt(44, 52)],
                            [SamplingParams(max_tokens=5, temperature=1.0, seed=1), params, GREEDY])
    assert batch[1].token_ids == ref.token_ids
    other = engine.generate([p], SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=6))[0]
    assert other.token_ids != ref.token_ids


def test_stop_token_ends_generation(mha_dir: Path) -> None:
    engine = Engine(mha_dir, num_pages=64)
    p = prompt(20, 60)
    tokens = engine.generate([p], GREEDY)[0].token_ids
    stop = tokens[3]
    out = engine.generate([p], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))[0]
    assert out.token_ids == tokens[:tokens.index(stop) + 1] and out.finish_reason == "stop"


def test_keep_logits_returns_every_step(mha_dir: Path) -> None:
    out = Engine(mha_dir, num_pages=64).generate([prompt(20, 61)], SamplingParams(max_tokens=6, keep_logits=True))[0]
    assert out.logits is not None and out.logits.shape == (6, 256)
    assert torch.equal(out.logits[0], out.first_logits)
    assert out.logits.argmax(-1).tolist() == out.token_ids


def test_requests_wait_for_pages_then_run(mha_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    prompts = [prompt(40, 70 + i) for i in range(3)]  # each needs ceil((40 + 11) / 16) = 4 pages
    engine = Engine(mha_dir, num_pages=9)
    with caplog.at_level("INFO", logger="kvtier.engine.scheduler"):
        outs = engine.generate(prompts, GREEDY)
    assert_same(outs, alone(mha_dir, prompts))
    assert any("waits for KV pages" in r.message for r in caplog.records)


def test_invalid_requests_are_refused(mha_dir: Path) -> None:
    engine = Engine(mha_dir, num_pages=4)
    with pytest.raises(CapacityError, match="needs 6 KV pages"):  # 70 + 11 KV tokens
        engine.add_request(prompt(70, 0), GREEDY)
    with pytest.raises(InvalidRequest, match="vocabulary|token ids"):
        engine.add_request([1, 256], GREEDY)
    with pytest.raises(InvalidRequest, match="positions"):
        engine.add_request([1] * 1000, SamplingParams(max_tokens=30))
    with pytest.raises(ValueError):
        engine.generate([[1], [2]], [GREEDY])
    with pytest.raises(InvalidRequest):  # a bad prompt in a batch: nothing of the batch is queued
        engine.generate([[1, 2], [300]], GREEDY)
    assert not engine.has_unfinished()
    assert engine.generate([[1, 2]], GREEDY)[0].token_ids and engine.stats.requests == 1


def test_step_by_step(mha_dir: Path) -> None:
    engine = Engine(mha_dir, num_pages=64)
    ids = [engine.add_request(prompt(n, n), SamplingParams(max_tokens=m)) for n, m in ((10, 2), (30, 5))]
    finished = []
    while engine.has_unfinished():
        finished.append([o.request_id for o in engine.step()])
    assert [x for x in finished if x] == [[ids[0]], [ids[1]]]
    assert engine.stats.steps == 5 and len(engine.stats.ttft_s) == 2


def test_a_given_connector_without_a_daemon_degrades_to_recompute(mha_dir: Path, tmp_path: Path) -> None:
    from kvtier.connector import KVConnectorCore, namespace_for_checkpoint

    ns = namespace_for_checkpoint(mha_dir, kv_dtype=torch.float32, block_tokens=16)
    with KVConnectorCore(ns, address=f"unix:{tmp_path}/nobody.sock", timeout_s=0.2) as connector:
        with pytest.raises(ValueError, match="16 tokens, the engine's pages 32"):
            Engine(mha_dir, num_pages=64, block_tokens=32, connector=connector)
        engine = Engine(mha_dir, num_pages=64, connector=connector)
        p = prompt(50, 80)
        out = engine.generate([p], GREEDY)[0]
        assert out.loaded_tokens == 0 and connector.stats.failed_calls > 0
        engine.close()  # not the engine's connector: it stays open
        assert engine.generate([p], GREEDY)[0].prefix_hit_tokens == 48
    assert_same([out], alone(mha_dir, [p]))
