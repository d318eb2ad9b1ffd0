"""Conformance with SGLang 0.5.23's own storage interface (run in the engine-interface environment).

These tests import SGLang's ``HiCacheStorage``, its ``StorageBackendFactory`` and its page hashing;
they are skipped where SGLang is not importable (the default venv). To run them::

    PYTHONPATH=/tmp/engine-iface/src /tmp/engine-iface/venv/bin/python -m pytest tests/connectors/kvtier_sglang -q
"""

from __future__ import annotations

import inspect
import secrets

import pytest
import torch

from kvtier_protocol.keys import SGLANG_SCHEME, ExtraKeys, chain_hashes, sglang_namespace_seed, to_hex
from tests.connectors.kvtier_sglang.sglkit import MHAHostPool, MLAHostPool, fill, host_indices, page_tensor

hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                              reason="SGLang's HiCache interfaces are not importable here (engine-interface env)")
storage = pytest.importorskip("sglang.srt.mem_cache.storage",
                              reason="SGLang's storage backend factory is not importable")
utils = pytest.importorskip("sglang.srt.mem_cache.utils", reason="SGLang's page hashing is not importable")

from kvtier_sglang.storage import KVTierStorage  # noqa: E402  (needs SGLang)

METHODS = ("get", "batch_get", "set", "batch_set", "exists", "batch_exists", "batch_get_v1", "batch_set_v1",
           "register_mem_pool_host", "clear")


def sglang_config(address: str, *, mla: bool = False, tp: tuple[int, int] = (0, 1), **extra: object):
    return hicache.HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="org/tiny-model",
        extra_config={"backend_name": "kvtier", "module_path": "kvtier_sglang.storage", "class_name": "KVTierStorage",
                      "interface_v1": 1, "address": address, "revision": "r1",
                      "model": f"conf-{secrets.token_hex(5)}", **extra})


def test_the_abc_is_satisfied_with_compatible_signatures() -> None:
    assert issubclass(KVTierStorage, hicache.HiCacheStorage)
    assert not inspect.isabstract(KVTierStorage) and KVTierStorage.__abstractmethods__ == frozenset()
    for name in hicache.HiCacheStorage.__abstractmethods__ | set(METHODS):
        ours, base = getattr(KVTierStorage, name), getattr(hicache.HiCacheStorage, name)
        assert ours is not base, f"{name} is inherited, not implemented"
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(base).parameters), name


def test_the_factory_constructs_ours_as_a_dynamic_backend(kvtier_daemon_module) -> None:
    config = sglang_config(kvtier_daemon_module.address)
    backend = storage.StorageBackendFactory.create_backend("dynamic", config, None)
    try:
        assert type(backend) is KVTierStorage and isinstance(backend, hicache.HiCacheStorage)
        # What the cache controller does next: register the host pool, then zero-copy I/O.
        src = MHAHostPool("page_first")
        fill(src, seed=1)
        backend.register_mem_pool_host(src)
        assert backend.mem_pool_host is src
        keys = [to_hex(h) for h in chain_hashes(list(range(12)), 4, scheme=SGLANG_SCHEME)]
        info = hicache.HiCacheStorageExtraInfo(prefix_keys=[])
        assert backend.batch_exists(keys, info) == 0
        assert backend.batch_set_v1(keys, host_indices([0, 1, 2], 4), info) == [True] * 3
        assert backend.batch_exists(keys[:hicache.STORAGE_BATCH_SIZE], info) == 3
        assert backend.batch_get_v1(keys, host_indices([5, 6, 7], 4), info) == [True] * 3
        assert all(torch.equal(page_tensor(src, a), page_tensor(src, b)) for a, b in ((0, 5), (1, 6), (2, 7)))
    finally:
        backend.close()


def test_the_mla_storage_writer_rule_is_sglangs(kvtier_daemon_module) -> None:
    for rank, writer in ((0, True), (1, False)):
        config = sglang_config(kvtier_daemon_module.address, mla=True, tp=(rank, 2))
        backend = storage.StorageBackendFactory.create_backend("dynamic", config, None)
        try:
            backend.register_mem_pool_host(MLAHostPool("page_first"))
            assert config.is_storage_writer is writer and backend.is_writer is writer
            assert (backend.ns.tp_rank, backend.ns.tp_size) == (0, 1)
        finally:
            backend.close()


@pytest.mark.parametrize(("extra_key", "cache_salt"), [(None, None), ("lora-a", None), (None, "tenant"), ("", "")])
def test_page_hashes_are_sglangs(extra_key, cache_salt) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200_000, (40,), generator=g).tolist()
    seed_hex = utils.storage_namespace_seed(extra_key, cache_salt)
    seed = sglang_namespace_seed(extra_key, cache_salt)
    assert (seed.hex() if seed is not None else None) == seed_hex
    theirs = utils.get_hash_str(ids, seed_hex, page_size=8)
    ours = chain_hashes(ids, 8, scheme=SGLANG_SCHEME, extras=ExtraKeys(lora_name=extra_key, cache_salt=cache_salt))
    assert theirs == [to_hex(h) for h in ours]


def test_large_token_ids_hash_as_sglang_does() -> None:
    ids = [1, 2**32 + 5, 3, 4]
    assert utils.get_hash_str(ids, None, page_size=4) == [to_hex(h) for h in chain_hashes(ids, 4, scheme=SGLANG_SCHEME)]
