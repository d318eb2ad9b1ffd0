"""HF transformers DynamicCache prefixes through a real kvtier daemon: save, load, continue.

The model is a tiny random Llama checkpoint (float32, CPU). Loaded K/V are bit-identical to the
computed ones (raw codec); the next-token logits after a loaded prefix equal those of a full
recompute to float32 rounding only (≤ 1e-5 relative, not bit-exact): the model then multiplies a
few query rows instead of all of them, and the GEMM/SDPA kernels block (and so sum) differently
for different row counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.connector import KVConnectorCore, namespace_for_checkpoint
from kvtier.connector.hf_cache import cache_argument, load_prefix, save_prefix
from kvtier.engine.checkpoint import make_random_checkpoint
from kvtier.engine.config import ModelConfig
from kvtier_protocol.errors import InvalidRequest, LayoutError, NamespaceError

transformers = pytest.importorskip("transformers")

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512)
BT = 16  # tokens per block
REL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_random_checkpoint(path, TINY, seed=0, dtype=torch.float32)
    return path


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture
def core(request: pytest.FixtureRequest, checkpoint: Path, kvtier_daemon_module) -> Iterator[KVConnectorCore]:
    # A model id per test: tests share the daemon, never each other's blocks.
    ns = namespace_for_checkpoint(checkpoint, kv_dtype=torch.float32, model=f"tiny-{request.node.name}")
    with KVConnectorCore(ns, address=kvtier_daemon_module.address) as c:
        yield c


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist()


class Step:
    """One forward pass: the last position's logits and the cache after it."""

    def __init__(self, out) -> None:
        self.logits = out.logits[0, -1]
        self.cache = out.cache if hasattr(out, "cache") else out.past_key_values


def _forward(model: torch.nn.Module, ids: list[int], cache=None) -> Step:
    with torch.inference_mode():
        return Step(model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1,
                          **{cache_argument(model): cache}))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_save_then_load_continues_like_recompute(model, core: KVConnectorCore) -> None:
    ids = _prompt(75, seed=1)
    full = _forward(model, ids)
    assert save_prefix(core, ids, full.cache) == 4  # 64 of 75 tokens are full blocks
    cache, n = load_prefix(core, ids, device="cpu", dtype=torch.float32, config=model.config)
    assert n == 64 and cache is not None and cache.get_seq_length() == 64
    for got, want in zip(cache.layers, full.cache.layers):
        assert torch.equal(got.keys, want.keys[:, :, :n]) and torch.equal(got.values, want.values[:, :, :n])
    hit = _forward(model, ids[n:], cache)
    assert _rel(hit.logits, full.logits) <= REL
    # The loaded cache keeps going: 8 greedy steps pick the same tokens as the recomputed one.
    a, b, ta, tb = hit.cache, full.cache, hit.logits.argmax().item(), full.logits.argmax().item()
    for _ in range(8):
        assert ta == tb
        oa, ob = _forward(model, [ta], a), _forward(model, [tb], b)
        assert _rel(oa.logits, ob.logits) <= REL
        a, b, ta, tb = oa.cache, ob.cache, oa.logits.argmax().item(), ob.logits.argmax().item()


def test_save_extends_a_stored_prefix_and_load_leaves_the_last_token(model, core: KVConnectorCore) -> None:
    ids = _prompt(80, seed=2)
    assert save_prefix(core, ids[:40], _forward(model, ids[:40]).cache) == 2
    full = _forward(model, ids)
    assert save_prefix(core, ids, full.cache) == 3  # blocks 2..4: the first two are already stored
    assert save_prefix(core, ids, full.cache) == 0
    cache, n = load_prefix(core, ids)  # 80 tokens are 5 full blocks; the last token is computed
    assert n == 64 and cache is not None
    assert _rel(_forward(model, ids[n:], cache).logits, full.logits) <= REL
    cache, n = load_prefix(core, ids[:81 - 16])  # 65 tokens: 4 blocks can be loaded
    assert n == 64


def test_miss_and_short_prompts(model, core: KVConnectorCore) -> None:
    assert load_prefix(core, _prompt(100, seed=3)) == (None, 0)
    assert load_prefix(core, _prompt(BT, seed=3)) == (None, 0)  # one block, but its last token is needed
    assert load_prefix(core, []) == (None, 0)
    ids = _prompt(BT - 1, seed=4)
    assert save_prefix(core, ids, _forward(model, ids).cache) == 0  # no full block


def test_daemon_down_means_recompute(model, checkpoint: Path, tmp_path: Path) -> None:
    ns = namespace_for_checkpoint(checkpoint, kv_dtype=torch.float32)
    ids = _prompt(40, seed=5)
    with KVConnectorCore(ns, address=f"unix:{tmp_path / 'absent.sock'}", timeout_s=0.5) as down:
        assert save_prefix(down, ids, _forward(model, ids).cache) == 0
        assert load_prefix(down, ids) == (None, 0)


def test_refuses_a_cache_of_another_namespace(model, checkpoint: Path, core: KVConnectorCore,
                                              kvtier_daemon_module) -> None:
    ids = _prompt(40, seed=6)
    cache = _forward(model, ids).cache
    bf16 = namespace_for_checkpoint(checkpoint, kv_dtype=torch.bfloat16, model="tiny-bf16")
    with KVConnectorCore(bf16, address=kvtier_daemon_module.address) as other:
        with pytest.raises(NamespaceError):
            save_prefix(other, ids, cache)
    with pytest.raises(NamespaceError):
        load_prefix(core, ids, dtype=torch.float16)
    with torch.inference_mode():
        batch2 = Step(model(input_ids=torch.tensor([ids, ids]), use_cache=True, logits_to_keep=1)).cache
    with pytest.raises(InvalidRequest):
        save_prefix(core, ids, batch2)
    cache.layers.pop()  # one layer short of the namespace's geometry
    with pytest.raises(LayoutError):
        save_prefix(core, ids, cache)


def test_int8_codec_is_close_not_exact(model, checkpoint: Path, kvtier_daemon_module) -> None:
    ns = namespace_for_checkpoint(checkpoint, kv_dtype=torch.float32, codec="int8", model="tiny-int8")
    ids = _prompt(70, seed=7)
    full = _forward(model, ids)
    with KVConnectorCore(ns, address=kvtier_daemon_module.address) as core:
        assert save_prefix(core, ids, full.cache) == 4
        cache, n = load_prefix(core, ids)
    assert n == 64 and cache is not None
    k_loaded, k_full = cache.layers[0].keys, full.cache.layers[0].keys[:, :, :n]
    assert not torch.equal(k_loaded, k_full) and _rel(k_loaded, k_full) < 0.05
    assert _rel(_forward(model, ids[n:], cache).logits, full.logits) < 0.05
