"""The engine is a real Llama / DeepSeek-V2: its logits match HF transformers on the same checkpoint.

transformers is a test dependency. Each variant writes a random checkpoint, loads it in both
implementations (float32, CPU) and compares the logits of several prompts, which the engine runs
as one batched, paged forward step and transformers runs one by one. The MoE variants load the
checkpoint's per-expert tensors (``mlp.experts.E.gate_proj.weight``, as DeepSeek-V2 ships them),
which transformers fuses on load.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.attention import AttnBatch
from kvtier.engine.checkpoint import load_model, make_random_checkpoint
from kvtier.engine.config import ModelConfig
from kvtier.engine.rope import inv_frequencies

transformers = pytest.importorskip("transformers")

T = 8
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # shorter than the prompts, so scaling matters
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)
MLA = dict(BASE, num_kv_heads=4, head_dim=24, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=12)
VARIANTS = {
    "llama-gqa": ModelConfig(**BASE, num_kv_heads=2, head_dim=16),
    "llama3-rope-scaling": ModelConfig(**BASE, num_kv_heads=2, head_dim=16, rope_theta=500000.0,
                                       rope_scaling=LLAMA3, rms_norm_eps=1e-5),
    "llama-tied": ModelConfig(**BASE, num_kv_heads=1, head_dim=32, tie_word_embeddings=True),
    "deepseek-v2-mla": ModelConfig(**MLA),
    "deepseek-v2-mla-q-lora-llama3": ModelConfig(**MLA, q_lora_rank=24, rope_scaling=LLAMA3),
    # MoE after a dense first layer (as DeepSeek-V2-Lite): routed + shared experts, scaled weights.
    "deepseek-v2-moe-greedy": ModelConfig(**MLA, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5),
    # As DeepSeek-V2: top-k among the experts of the best groups, one shared expert, q LoRA.
    "deepseek-v2-moe-group-limited": ModelConfig(**MLA, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3,
                                                 moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                                 topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                 routed_scaling_factor=16.0),
}
PROMPT_LENS = (5, 23, 41)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny GEMMs on a busy 2-core VM are far faster on one thread (no OpenMP waits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts in one paged forward step; each gets its own run of pages."""
    tables, slots, start = [], [], 0
    for p in prompts:
        pages = -(-len(p) // T)
        tables.append(list(range(start, start + pages)))
        slots += [tables[-1][i // T] * T + i % T for i in range(len(p))]
        start += pages
    caches = [torch.zeros(model.kv_cache_shape(start, T)) for _ in range(model.config.num_layers)]
    batch = AttnBatch([len(p) for p in prompts], [len(p) for p in prompts], tables, torch.tensor(slots), T)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    return list(model(ids, positions, batch, caches).split([len(p) for p in prompts]))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(tmp_path, name):
    make_random_checkpoint(tmp_path, VARIANTS[name], seed=11)
    ours = load_model(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    expected_cls = "DeepseekV2ForCausalLM" if ours.config.is_mla else "LlamaForCausalLM"
    assert type(hf).__name__ == expected_cls
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        for prompt, got in zip(prompts, engine_logits(ours, prompts)):
            want = hf(torch.tensor([prompt])).logits[0].float()
            rel = (got - want).abs().max() / want.abs().max()
            assert rel <= 1e-4, f"{name}: relative difference {rel:.2e} for a prompt of {len(prompt)} tokens"


def test_llama3_inverse_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                                         max_position_embeddings=131072,
                                         rope_parameters={"rope_theta": 500000.0, **LLAMA3,
                                                          "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    got = inv_frequencies(128, 500000.0, {**LLAMA3, "original_max_position_embeddings": 8192})
    assert torch.equal(got, want)
