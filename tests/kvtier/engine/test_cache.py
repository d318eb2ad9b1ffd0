"""PageAllocator (pure bookkeeping) and KVCache (the per-layer tensors of a real model)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier_protocol.keys import chain_hashes

from kvtier.engine.cache import PageAllocator

ROOT = Path(__file__).resolve().parents[3]
H = chain_hashes(list(range(16 * 6)), 16)  # six real chain hashes, one per block


def test_fresh_pages_in_order_with_one_user_each() -> None:
    a = PageAllocator(4, 16)
    assert a.allocate([], 3) == [0, 1, 2]
    assert [a.ref_count(p) for p in range(4)] == [1, 1, 1, 0]
    assert a.num_free == 1


def test_allocate_refuses_without_changing_anything() -> None:
    a = PageAllocator(3, 16)
    assert a.allocate([], 2) == [0, 1]
    assert a.allocate([], 2) is None
    assert a.num_free == 1 and a.ref_count(2) == 0


def test_freed_pages_are_reused_oldest_first() -> None:
    a = PageAllocator(4, 16)
    t1, t2 = a.allocate([], 2), a.allocate([], 2)
    a.free(t2)  # released last-first: 3 then 2 join the free list
    a.free(t1)  # 1 then 0
    assert a.allocate([], 4) == [3, 2, 1, 0]


def test_shared_prefix_counts_users_and_survives_free() -> None:
    a = PageAllocator(6, 16)
    t1 = a.allocate([], 3)
    assert a.cache(H[0], t1[0]) and a.cache(H[1], t1[1])
    assert a.num_cached_blocks(H) == 2
    t2 = a.allocate(H[:2], 1)
    assert t2[:2] == t1[:2] and t2[2] not in t1
    assert a.ref_count(t1[0]) == 2 and a.ref_count(t1[2]) == 1
    a.free(t1)
    assert a.ref_count(t1[0]) == 1 and a.num_free == 3  # t1's own third page only
    a.free(t2)
    assert a.num_free == 6 and a.num_cached == 2  # free, but still named
    # Sharing a free named page takes it off the free list again.
    assert a.num_pages_to_take(H[:2], 1) == 3
    t3 = a.allocate(H[:2], 1)
    assert t3[:2] == t1[:2] and a.num_free == 3 and a.ref_count(t1[0]) == 1


def test_reusing_a_named_free_page_forgets_its_prefix() -> None:
    a = PageAllocator(2, 16)
    t = a.allocate([], 1)
    a.cache(H[0], t[0])
    a.free(t)
    assert a.allocate([], 2) is not None  # takes every page, the named one included
    assert a.page_of(H[0]) is None and a.num_cached_blocks(H) == 0


def test_second_copy_of_a_block_is_not_named() -> None:
    a = PageAllocator(4, 16)
    t1, t2 = a.allocate([], 1), a.allocate([], 1)
    assert a.cache(H[0], t1[0])
    assert not a.cache(H[0], t2[0])
    assert a.page_of(H[0]) == t1[0]
    assert a.cache(H[0], t1[0])  # naming the same page again is a no-op


def test_reset_prefix_cache_forgets_only_free_pages() -> None:
    a = PageAllocator(4, 16)
    t1, t2 = a.allocate([], 1), a.allocate([], 1)
    a.cache(H[0], t1[0])
    a.cache(H[1], t2[0])
    a.free(t1)
    assert a.reset_prefix_cache() == 1
    assert a.page_of(H[0]) is None and a.page_of(H[1]) == t2[0]


def test_page_zero_is_an_ordinary_page() -> None:
    a = PageAllocator(1, 16)
    t = a.allocate([], 1)
    assert t == [0]
    a.cache(H[0], 0)
    a.free(t)
    assert a.allocate(H[:1], 0) == [0]


def test_invalid_sizes() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0, 16)
    with pytest.raises(ValueError):
        PageAllocator(4, 0)


def test_random_operations_keep_counts_consistent() -> None:
    rng = random.Random(5)
    a = PageAllocator(16, 4)
    tables: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            shared = H[:a.num_cached_blocks(H[:rng.randint(0, 3)])]
            t = a.allocate(shared, rng.randint(0, 4))
            if t is not None:
                tables.append(t)
                for i, page in enumerate(t[len(shared):len(shared) + 1]):  # name one fresh page sometimes
                    if rng.random() < 0.3:
                        a.cache(H[len(shared) + i], page)
        elif tables:
            a.free(tables.pop(rng.randrange(len(tables))))
        refs = [0] * 16
        for t in tables:
            for page in t:
                refs[page] += 1
        assert [a.ref_count(p) for p in range(16)] == refs
        assert a.num_free == refs.count(0)
        for h in H:  # a named page holds its hash until reused
            p = a.page_of(h)
            assert p is None or a._hash_of[p] == h


def test_bookkeeping_imports_no_torch() -> None:
    code = "import sys, kvtier.engine.cache, kvtier.engine.scheduler; assert 'torch' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protocol")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_kv_cache_has_the_models_page_geometry(attention: str) -> None:
    import torch

    from kvtier.engine.cache import KVCache
    from kvtier.engine.config import ModelConfig
    from kvtier.engine.model import Model

    if attention == "mha":
        cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=16)
        shape, per_token = (2, 10, 8, 2, 16), 2 * 2 * 16
    else:
        cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3, num_heads=4,
                          num_kv_heads=4, head_dim=24, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8,
                          qk_nope_head_dim=16, v_head_dim=16)
        shape, per_token = (10, 8, 40), 40
    model = Model(cfg, device="meta")
    cache = KVCache(model, 10, 8, dtype=torch.bfloat16)
    assert len(cache.layers) == 3
    assert all(t.shape == shape and t.dtype == torch.bfloat16 and not t.any() for t in cache.layers)
    assert cache.page_bytes == 3 * 8 * per_token * 2 == KVCache.bytes_per_page(model, 8, torch.bfloat16)
    assert cache.nbytes == 10 * cache.page_bytes
