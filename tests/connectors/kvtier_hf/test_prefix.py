"""kvtier_hf against a real daemon: a tiny random LlamaForCausalLM (float32, CPU) prefills a prompt,
another prefix cache (a second process, say) loads it, and the next-token logits equal HF's own
recompute (to float32 rounding: fewer query rows make the kernels sum in another order)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine.checkpoint import make_random_checkpoint
from kvtier.engine.config import ModelConfig
from kvtier_hf import HFPrefixCache, cache_argument
from kvtier_protocol.errors import LayoutError, NamespaceError

transformers = pytest.importorskip("transformers")

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512)
BT = 16
REL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-hf")
    make_random_checkpoint(path, TINY, seed=0, dtype=torch.float32)
    return path


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist()


def recompute(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1).logits[0, -1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_prefill_reuses_a_stored_prefix_with_recompute_logits(model, kvtier_daemon_module, request) -> None:
    addr, name = kvtier_daemon_module.address, f"hf-{request.node.name}"
    ids = prompt(75, seed=1)
    with HFPrefixCache.for_model(model, address=addr, block_tokens=BT, model_id=name) as first:
        out = first.prefill(ids, logits_to_keep=1)
        assert (out.reused_tokens, out.saved_blocks) == (0, 4)  # 64 of 75 tokens are full blocks
        assert out.cache.get_seq_length() == 75
    with HFPrefixCache.for_model(model, address=addr, block_tokens=BT, model_id=name, accept_lossy=False) as exact:
        assert exact.core.accept_lossy is False and exact.load(ids)[1] == 64  # raw copies are exact copies
    with HFPrefixCache.for_model(model, address=addr, block_tokens=BT, model_id=name) as second:
        cache, n = second.load(ids)
        assert n == 64 and cache.get_seq_length() == 64
        for got, want in zip(cache.layers, out.cache.layers):  # exactly the K/V the model computed
            assert torch.equal(got.keys, want.keys[:, :, :64]) and torch.equal(got.values, want.values[:, :, :64])
        again = second.prefill(ids, logits_to_keep=1)
        assert (again.reused_tokens, again.saved_blocks) == (64, 0)
        assert again.logits.shape[1] == 1
        assert rel(again.logits[0, -1], recompute(model, ids)) <= REL
        # A prompt sharing the first 40 tokens reuses the two whole blocks among them.
        other = ids[:40] + prompt(30, seed=2)
        shared = second.prefill(other, logits_to_keep=1)
        assert (shared.reused_tokens, shared.saved_blocks) == (32, 2)
        assert rel(shared.logits[0, -1], recompute(model, other)) <= REL


def test_the_loaded_cache_keeps_decoding_like_the_computed_one(model, kvtier_daemon_module, request) -> None:
    ids = prompt(50, seed=3)
    with HFPrefixCache.for_model(model, address=kvtier_daemon_module.address, block_tokens=BT,
                                 model_id=f"hf-{request.node.name}") as kv:
        kv.prefill(ids)
        hit = kv.prefill(ids, logits_to_keep=1)
        assert hit.reused_tokens == 48
        with torch.inference_mode():
            full = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        a, b = hit.cache, full.past_key_values if getattr(full, "cache", None) is None else full.cache
        ta, tb = hit.logits[0, -1].argmax().item(), full.logits[0, -1].argmax().item()
        for _ in range(6):  # greedy decoding from either cache picks the same tokens
            assert ta == tb
            with torch.inference_mode():
                oa = model(input_ids=torch.tensor([[ta]]), use_cache=True, **{cache_argument(model): a})
                ob = model(input_ids=torch.tensor([[tb]]), use_cache=True, **{cache_argument(model): b})
            assert rel(oa.logits[0, -1], ob.logits[0, -1]) <= REL
            ta, tb = oa.logits[0, -1].argmax().item(), ob.logits[0, -1].argmax().item()


def test_daemon_outage_gives_misses_not_errors(model, kvtier_daemon, request) -> None:
    ids = prompt(40, seed=4)
    with HFPrefixCache.for_model(model, address=kvtier_daemon.address, block_tokens=BT, timeout_s=60.0,
                                 model_id=f"hf-{request.node.name}") as kv:
        assert kv.prefill(ids).saved_blocks == 2
        kvtier_daemon.stop()
        out = kv.prefill(ids, logits_to_keep=1)
        assert (out.reused_tokens, out.saved_blocks) == (0, 0)  # computed in full, nothing stored
        assert rel(out.logits[0, -1], recompute(model, ids)) <= REL
        assert kv.load(ids) == (None, 0)


def test_needs_a_checkpoint_directory_and_standard_attention(model, checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(NamespaceError, match="checkpoint"):
        HFPrefixCache.for_model(model, checkpoint=tmp_path / "absent")
    mla = tmp_path / "mla"
    mla.mkdir()
    (mla / "config.json").write_text('{"model_type": "deepseek_v3", "num_hidden_layers": 2, '
                                     '"kv_lora_rank": 32, "qk_rope_head_dim": 8}')
    (mla / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes()[:64])
    with pytest.raises(LayoutError, match="MLA"):
        HFPrefixCache.for_model(model, checkpoint=mla)
    kv = HFPrefixCache.for_model(model, address=f"unix:{tmp_path / 'none.sock'}")  # name_or_path is the dir
    assert kv.core.ns.revision.startswith("sha256:") and kv.core.ns.kv_dtype == "float32"
    kv.close()
