"""The worker path on CUDA caches: 0.33 strided views on the GPU, saved and loaded through the daemon."""

from __future__ import annotations

import secrets

import pytest
import torch

from tests.connectors.kvtier_vllm.vllmkit import (BLOCK, KvtierDaemon, Request, kv_cache_config, make_caches,
                                                   vllm_config)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_worker_saves_and_loads_cuda_pages(tmp_path):
    from kvtier_vllm import KVTierConnector
    from kvtier_vllm.compat import KVConnectorRole
    from kvtier_vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
    daemon = KvtierDaemon(tmp_path).start()
    try:
        config = vllm_config(daemon.address, model=f"cuda-{secrets.token_hex(4)}")
        workers = [KVTierConnector(config, KVConnectorRole.WORKER, kv_cache_config("v033-lbnhc")) for _ in range(2)]
        src, dst = make_caches("v033-lbnhc", "cuda"), make_caches("v033-lbnhc", "cuda")
        for t in src.values():
            t.copy_(torch.randn(t.shape, device="cuda"))
        workers[0].register_kv_caches(src)
        workers[1].register_kv_caches(dst)
        req = Request("g", list(range(3 * BLOCK + 1)))
        keys = req.block_hashes[:3]
        workers[0].bind_connector_metadata(KVTierMetadata(saves=[SaveSpec("g", 0, keys, [1, 2, 3],
                                                                          req.all_token_ids[:3 * BLOCK], None)]))
        workers[0].wait_for_save()
        workers[0].worker.wait_idle(30.0)
        workers[1].bind_connector_metadata(KVTierMetadata(loads=[LoadSpec("g", keys, [7, 8, 9], is_async=False)]))
        workers[1].start_load_kv(None)
        assert workers[1].get_block_ids_with_load_errors() == set()
        torch.cuda.synchronize()
        for name in src:
            assert torch.equal(dst[name][[7, 8, 9]], src[name][[1, 2, 3]])
        for w in workers:
            w.shutdown()
    finally:
        daemon.cleanup()
