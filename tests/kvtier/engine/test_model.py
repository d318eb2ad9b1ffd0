"""Model over the paged cache: prefill, chunked prefill and decode agree bit for bit; batching is exact.

The claims tested here (CPU, float32): a token's logits depend only on its position and the K/V
values in the cache, not on how the prompt was split into steps, on other sequences in the batch,
or on which pages hold the context. That is what makes a prefix loaded from kvtier give the
logits of a full recompute.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.engine.attention import AttnBatch, causal_attention
from kvtier.engine.checkpoint import load_model, make_random_checkpoint
from kvtier.engine.config import ModelConfig
from kvtier.engine.model import Model
from kvtier_protocol.errors import InvalidRequest

T = 4  # tokens per page: small, so prompts span many pages

MHA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16)
MLA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=24, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, v_head_dim=12, q_lora_rank=24)
CONFIGS = {"mha": MHA, "mla": MLA}


@pytest.fixture(autouse=True)
def one_thread():
    """Run on one thread: on a busy 2-core VM, two-thread GEMMs of these tiny matrices spend
    milliseconds each in OpenMP waits (20x slower). test_bit_exact_with_two_threads covers two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, cfg in CONFIGS.items():
        path = tmp_path_factory.mktemp(name)
        make_random_checkpoint(path, cfg, seed=7)
        out[name] = str(path)
    return out


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_caches(model: Model, num_pages: int = 64) -> list[torch.Tensor]:
    return [torch.zeros(model.kv_cache_shape(num_pages, T)) for _ in range(model.config.num_layers)]


def step(model: Model, caches: list[torch.Tensor],
         seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """One forward over ``(new_tokens, cached_len, block_table)`` per sequence; logits of every new token."""
    ids, positions, slots = [], [], []
    for new, cached, table in seqs:
        for j, token in enumerate(new):
            p = cached + j
            ids.append(token)
            positions.append(p)
            slots.append(table[p // T] * T + p % T)
    batch = AttnBatch(query_lens=[len(s[0]) for s in seqs], context_lens=[s[1] + len(s[0]) for s in seqs],
                      block_tables=[s[2] for s in seqs], slot_mapping=torch.tensor(slots, dtype=torch.int64),
                      block_tokens=T)
    return model(torch.tensor(ids), torch.tensor(positions), batch, caches)


def run_split(model: Model, prompt: list[int], cuts: list[int], table: list[int]) -> torch.Tensor:
    """Logits of every prompt token when the prompt is fed in steps ending at ``cuts``."""
    caches, outs, start = new_caches(model), [], 0
    for end in [*cuts, len(prompt)]:
        outs.append(step(model, caches, [(prompt[start:end], start, table)]))
        start = end
    return torch.cat(outs)


def test_kv_cache_shape_and_layout(checkpoints):
    mha, mla = load_model(checkpoints["mha"]), load_model(checkpoints["mla"])
    assert mha.kv_cache_shape(10, 16) == (2, 10, 16, 2, 16) and mha.kv_block_layout == "vllm-flash"
    assert mla.kv_cache_shape(10, 16) == (10, 16, 32 + 8) and mla.kv_block_layout == "mla-latent"


@pytest.mark.parametrize("chunk_tokens", [8, 64], ids=["multi-chunk", "one-chunk"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_prefill_chunked_and_decode_are_bit_exact(checkpoints, kind, chunk_tokens):
    model = load_model(checkpoints[kind])
    model.attn_chunk_tokens = chunk_tokens
    prompt = tokens(33, seed=1)
    table = list(range(40))[::-3] + list(range(1, 40, 3))  # scattered pages
    whole = run_split(model, prompt, [], table)
    assert whole.shape == (33, 256) and whole.dtype == torch.float32 and torch.isfinite(whole).all()
    for cuts in ([4], [12], [28], [12, 13, 30]):  # whole pages cached, then the rest (or more chunks)
        assert torch.equal(run_split(model, prompt, cuts, table), whole), cuts
    decode = run_split(model, prompt, list(range(1, 33)), table)
    assert torch.equal(decode, whole)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_bit_exact_with_two_threads(checkpoints, kind):
    """MKL splits GEMM rows over threads; the row padding in Linear keeps that split harmless."""
    torch.set_num_threads(2)
    model = load_model(checkpoints[kind])
    prompt, table = tokens(21, seed=9), list(range(6))
    whole = run_split(model, prompt, [], table)
    assert torch.equal(run_split(model, prompt, [8], table), whole)
    assert torch.equal(run_split(model, prompt, [8, 17, 18, 19, 20], table), whole)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_prefix_pages_copied_to_another_cache_give_recompute_logits(checkpoints, kind):
    """What a kvtier hit does: prefix pages written by one request, copied into other pages, reused."""
    model = load_model(checkpoints[kind])
    shared = tokens(24, seed=2)
    first, second = shared + tokens(9, seed=3), shared + tokens(14, seed=4)
    donor = new_caches(model)
    step(model, donor, [(first, 0, list(range(9)))])  # donor pages 0..8; the shared prefix is pages 0..5
    caches = new_caches(model)
    table = [40, 17, 3, 29, 11, 50, 8, 61, 22, 35]
    for cache, src in zip(caches, donor):  # copy pages 0..5 into the table's first six pages
        if model.config.is_mla:
            cache[table[:6]] = src[:6]
        else:
            cache[:, table[:6]] = src[:, :6]
    reused = step(model, caches, [(second[24:], 24, table)])
    recompute = run_split(model, second, [], table)[24:]
    assert torch.equal(reused, recompute)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_batched_sequences_equal_each_alone(checkpoints, kind):
    model = load_model(checkpoints[kind])
    a, b, c = tokens(13, seed=5), tokens(21, seed=6), tokens(30, seed=7)
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    caches = new_caches(model)
    # Prime b (20 cached) and c (9 cached), then one step: a prefills, b decodes, c continues a chunk.
    step(model, caches, [(b[:20], 0, tables[1]), (c[:9], 0, tables[2])])
    batched = step(model, caches, [(a, 0, tables[0]), (b[20:], 20, tables[1]), (c[9:], 9, tables[2])])
    alone = [run_split(model, a, [], tables[0]), run_split(model, b, [20], tables[1])[20:],
             run_split(model, c, [9], tables[2])[9:]]
    assert torch.equal(batched, torch.cat(alone))


def test_logits_rows_selects_rows(checkpoints):
    model = load_model(checkpoints["mha"])
    prompt = tokens(11, seed=8)
    full = run_split(model, prompt, [], list(range(3)))
    ids = torch.tensor(prompt)
    batch = AttnBatch([11], [11], [list(range(3))], torch.arange(11), T)
    some = model(ids, torch.arange(11), batch, new_caches(model), logits_rows=torch.tensor([10, 3]))
    assert torch.equal(some, full[[10, 3]])


def naive_attention(q, k, v, q_start, scale):
    """Reference: repeat K/V per query head, full softmax with a causal mask."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = q_start + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("q_start,n,chunk", [(0, 1, 64), (0, 37, 8), (50, 5, 16), (19, 70, 32), (100, 1, 8)])
def test_causal_attention_matches_naive_reference(q_start, n, chunk):
    gen = torch.Generator().manual_seed(q_start * 100 + n)
    q = torch.randn(n, 6, 12, generator=gen)
    k = torch.randn(q_start + n, 2, 12, generator=gen)
    v = torch.randn(q_start + n, 2, 10, generator=gen)  # value width differs, as in MLA
    out = causal_attention(q, k, v, q_start=q_start, scale=12 ** -0.5, chunk_tokens=chunk)
    ref = naive_attention(q, k, v, q_start, 12 ** -0.5)
    assert out.shape == (n, 6, 10)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_bad_batches_and_caches_raise_invalid_request(checkpoints):
    model = load_model(checkpoints["mha"])
    ids, pos, caches = torch.tensor([1, 2, 3]), torch.arange(3), new_caches(model, num_pages=4)
    bad_batches = {
        "sum": AttnBatch([2], [2], [[0]], torch.arange(3), T),
        "lengths": AttnBatch([3], [3, 1], [[0]], torch.arange(3), T),
        "query>context": AttnBatch([3], [2], [[0]], torch.arange(3), T),
        "pages": AttnBatch([3], [7], [[0]], torch.arange(3), T),
    }
    for batch in bad_batches.values():
        with pytest.raises(InvalidRequest, match="AttnBatch"):
            model(ids, pos, batch, caches)
    good = AttnBatch([3], [3], [[0]], torch.arange(3), T)
    with pytest.raises(InvalidRequest, match="layers"):
        model(ids, pos, good, caches[:1])
    with pytest.raises(InvalidRequest, match="shape"):
        model(ids, pos, good, [torch.zeros(2, 4, T, 2, 8)] * 2)
    with pytest.raises(InvalidRequest, match="positions"):
        model(ids, torch.arange(4), good, caches)
