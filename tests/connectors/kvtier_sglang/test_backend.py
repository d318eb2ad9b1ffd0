"""The SGLang HiCache backend against a real kvtier daemon, driven in SGLang's call order.

Host pools are CPU tensors in SGLang's own layouts (sglkit); pages written by one "engine" (a
backend on one pool) are read by another (a fresh backend on another pool, other page ids), the
way a restarted or second SGLang server would, and must come back bit-identical.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import torch

from kvtier.client import Client
from kvtier_protocol.errors import InvalidRequest, LayoutError, NamespaceError
from kvtier_protocol.header import decode_header
from kvtier_protocol.keys import from_hex
from kvtier_sglang import PageBackend
from tests.connectors.kvtier_sglang.sglkit import (MHAHostPool, MLAHostPool, StorageConfig, fill, hit_query,
                                                   host_indices, page_backup, page_hashes, page_tensor,
                                                   page_transfer)
from tests.kvtier.waitkit import wait_until

CASES = [("mha", lay) for lay in ("layer_first", "page_first", "page_first_direct", "page_head")]
CASES += [("mla", lay) for lay in ("layer_first", "page_first", "page_first_direct")]


def make_pool(attention: str, layout: str, **kw: object):
    return MLAHostPool(layout, **kw) if attention == "mla" else MHAHostPool(layout, **kw)


def make_backend(address: str, pool, *, model: str, mla: bool = False, tp: tuple[int, int] = (0, 1),
                 **extra: object) -> PageBackend:
    config = StorageConfig(tp_rank=tp[0], tp_size=tp[1], is_mla_model=mla, model_name="org/tiny-model",
                           extra_config={"backend_name": "kvtier", "module_path": "kvtier_sglang.storage",
                                         "class_name": "KVTierStorage", "interface_v1": 1, "address": address,
                                         "model": model, "revision": "r1", **extra})
    backend = PageBackend(config, {})
    backend.register_mem_pool_host(pool)
    return backend


@pytest.fixture
def model() -> str:
    return f"sgl-{secrets.token_hex(5)}"  # tests share the daemon, never each other's pages


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (n,), generator=g).tolist()


@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1", "legacy"])
@pytest.mark.parametrize(("attention", "layout"), CASES)
def test_pages_round_trip_between_engines(kvtier_daemon_module, model, attention, layout, zero_copy) -> None:
    src, dst = make_pool(attention, layout), make_pool(attention, layout)
    fill(src, seed=1)
    mla = attention == "mla"
    hashes = page_hashes(tokens(6 * src.page_size), src.page_size)
    writer = make_backend(kvtier_daemon_module.address, src, model=model, mla=mla)
    reader = make_backend(kvtier_daemon_module.address, dst, model=model, mla=mla)
    try:
        assert hit_query(reader, hashes) == []
        saved = page_backup(writer, hashes, host_indices([2, 3, 5, 7, 11, 13], src.page_size), src.page_size,
                            zero_copy=zero_copy, pool=src, prefix_keys=[])
        assert saved == 6 * src.page_size
        hit = hit_query(reader, hashes, prefix_keys=[])
        assert hit == hashes
        dst_pages = [15, 14, 0, 1, 9, 8]
        assert page_transfer(reader, hit, host_indices(dst_pages, dst.page_size), dst.page_size,
                             zero_copy=zero_copy, pool=dst, prefix_keys=[]) == 6
        for s, d in zip([2, 3, 5, 7, 11, 13], dst_pages):
            assert torch.equal(page_tensor(dst, d), page_tensor(src, s))
        assert not dst.kv_buffer[..., 0].eq(0).all()  # sanity: something was written
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize(("attention", "src_layout", "dst_layout", "src_v1", "dst_v1"), [
    ("mha", "layer_first", "layer_first", True, False),  # vllm-flash regions read as a flat page
    ("mha", "page_first", "page_head", True, True),
    ("mha", "page_head", "layer_first", False, True),
    ("mla", "page_first", "layer_first", True, False),
])
def test_a_page_loads_in_any_form_and_layout(kvtier_daemon_module, model, attention, src_layout, dst_layout,
                                             src_v1, dst_v1) -> None:
    src, dst = make_pool(attention, src_layout), make_pool(attention, dst_layout)
    fill(src, seed=2)
    mla = attention == "mla"
    hashes = page_hashes(tokens(3 * src.page_size, seed=2), src.page_size)
    with_src = make_backend(kvtier_daemon_module.address, src, model=model, mla=mla)
    with_dst = make_backend(kvtier_daemon_module.address, dst, model=model, mla=mla)
    try:
        page_backup(with_src, hashes, host_indices([0, 1, 2], 4), 4, zero_copy=src_v1, pool=src)
        assert page_transfer(with_dst, hashes, host_indices([5, 6, 7], 4), 4, zero_copy=dst_v1, pool=dst) == 3
        # The same token range of every layer, K and V, whatever the byte order of each pool.
        for s, d in zip([0, 1, 2], [5, 6, 7]):
            want = src.get_data_page(s * 4, flat=True)
            got = dst.get_data_page(d * 4, flat=True)
            assert torch.equal(_canonical(src, want), _canonical(dst, got))
    finally:
        with_src.close()
        with_dst.close()


def _canonical(pool, flat: torch.Tensor) -> torch.Tensor:
    """A flat page as [L, 2, T, H, D] (MHA) or [L, T, C] (MLA), whatever the pool's layout."""
    t, l = pool.page_size, pool.layer_num
    if isinstance(pool, MLAHostPool):
        c = pool.kv_cache_dim
        return flat.reshape(t, l, c).transpose(0, 1) if pool.layout == "page_first" else flat.reshape(l, t, c)
    h, d = pool.head_num, pool.head_dim
    if pool.layout == "page_first":
        return flat.reshape(2, t, l, h, d).permute(2, 0, 1, 3, 4)
    if pool.layout == "page_head":
        return flat.reshape(2, h, t, l, d).permute(3, 0, 2, 1, 4)
    return flat.reshape(2, l, t, h, d).transpose(0, 1)  # layer_first and page_first_direct flat pages


def test_prefix_semantics_and_untouched_pages_after_a_miss(kvtier_daemon_module, model) -> None:
    src, dst = MHAHostPool("page_first"), MHAHostPool("page_first")
    fill(src, seed=3)
    hashes = page_hashes(tokens(6 * 4, seed=3), 4)
    b_src = make_backend(kvtier_daemon_module.address, src, model=model)
    b_dst = make_backend(kvtier_daemon_module.address, dst, model=model)
    try:
        assert b_src.batch_set_v1(hashes[:4], host_indices([0, 1, 2, 3], 4)) == [True] * 4
        assert b_dst.batch_exists(hashes) == 4
        assert b_dst.batch_exists(hashes[4:]) == 0
        assert [b_dst.exists(h) for h in hashes] == [True] * 4 + [False] * 2
        before = page_tensor(dst, 9)
        assert b_dst.batch_get_v1(hashes, host_indices([4, 5, 6, 7, 8, 9], 4)) == [True] * 4 + [False] * 2
        assert torch.equal(page_tensor(dst, 9), before)
        assert b_dst.get(hashes[5]) is None
        assert torch.equal(b_dst.get(hashes[1]), src.get_data_page(4))
        # Storing a prefix again stores only what is missing, and every key reports success.
        assert b_src.batch_set_v1(hashes, host_indices([0, 1, 2, 3, 4, 5], 4)) == [True] * 6
        assert b_dst.batch_exists(hashes) == 6
    finally:
        b_src.close()
        b_dst.close()


def test_batches_of_128_pages_chain_their_parents(kvtier_daemon_module, model) -> None:
    geometry = {"layer_num": 1, "head_num": 1, "head_dim": 4, "page_size": 2, "page_num": 140}
    src, dst = MHAHostPool("page_first", **geometry), MHAHostPool("page_first", **geometry)
    fill(src, seed=4)
    hashes = page_hashes(tokens(130 * 2, seed=4), 2)
    before = page_hashes(tokens(2, seed=99), 2)  # a page before this call's keys
    b_src = make_backend(kvtier_daemon_module.address, src, model=model)
    b_dst = make_backend(kvtier_daemon_module.address, dst, model=model)
    try:
        pages = list(range(130))
        assert page_backup(b_src, hashes, host_indices(pages, 2), 2, zero_copy=True, pool=src,
                           prefix_keys=before) == 260
        assert hit_query(b_dst, hashes, prefix_keys=before) == hashes
        assert page_transfer(b_dst, hashes, host_indices(pages[::-1], 2), 2, zero_copy=True, pool=dst) == 130
        assert all(torch.equal(page_tensor(dst, 129 - p), page_tensor(src, p)) for p in pages)
        with Client(kvtier_daemon_module.address) as client:
            keys = [from_hex(hashes[0]), from_hex(hashes[127]), from_hex(hashes[128])]
            parents = [decode_header(r)[0].parent_hash for r in client.load(b_src.ns.ns_id, keys)]
        assert parents == [from_hex(before[-1]), from_hex(hashes[126]), from_hex(hashes[127])]
    finally:
        b_src.close()
        b_dst.close()


def test_tp_ranks_are_separate_shards_and_mla_has_one_writer(kvtier_daemon_module, model) -> None:
    addr = kvtier_daemon_module.address
    hashes = page_hashes(tokens(2 * 4, seed=5), 4)
    r0, r1 = MHAHostPool("page_first"), MHAHostPool("page_first")
    fill(r0, seed=5)
    b0 = make_backend(addr, r0, model=model, tp=(0, 2))
    b1 = make_backend(addr, r1, model=model, tp=(1, 2))
    m0, m1 = MLAHostPool("page_first"), MLAHostPool("page_first")
    fill(m0, seed=6)
    fill(m1, seed=7)
    mla0 = make_backend(addr, m0, model=model, mla=True, tp=(0, 2))
    mla1 = make_backend(addr, m1, model=model, mla=True, tp=(1, 2))
    try:
        assert b0.ns.tp_rank == 0 and b1.ns.tp_rank == 1 and b0.ns.ns_id != b1.ns.ns_id
        assert b0.batch_set_v1(hashes, host_indices([0, 1], 4)) == [True, True]
        assert b1.batch_exists(hashes) == 0  # rank 1's heads are not rank 0's
        assert mla0.ns.ns_id == mla1.ns.ns_id and (mla0.ns.tp_rank, mla0.ns.tp_size) == (0, 1)
        assert mla1.batch_set_v1(hashes, host_indices([0, 1], 4)) == [True, True]  # not the writer
        assert mla0.batch_exists(hashes) == 0  # ... so nothing was written
        assert mla0.batch_set_v1(hashes, host_indices([0, 1], 4)) == [True, True]
        assert mla1.batch_get_v1(hashes, host_indices([2, 3], 4)) == [True, True]
        assert torch.equal(page_tensor(m1, 2), page_tensor(m0, 0))
    finally:
        for b in (b0, b1, mla0, mla1):
            b.close()


def test_a_lossy_codec_is_a_namespace_of_its_own(kvtier_daemon_module, model) -> None:
    src, dst = MHAHostPool("page_first", dtype=torch.bfloat16), MHAHostPool("page_first", dtype=torch.bfloat16)
    fill(src, seed=8)
    hashes = page_hashes(tokens(2 * 4, seed=8), 4)
    raw = make_backend(kvtier_daemon_module.address, src, model=model)
    int8 = make_backend(kvtier_daemon_module.address, src, model=model, codec="int8")
    reader = make_backend(kvtier_daemon_module.address, dst, model=model, codec="int8")
    try:
        assert int8.batch_set_v1(hashes, host_indices([0, 1], 4)) == [True, True]
        assert raw.batch_exists(hashes) == 0  # raw readers never get quantized KV
        assert reader.batch_get_v1(hashes, host_indices([0, 1], 4)) == [True, True]
        for page in (0, 1):
            want, got = page_tensor(src, page).float(), page_tensor(dst, page).float()
            err = (got - want).abs().max().item()
            assert 0 < err < 0.05 * want.abs().max().item()  # close, not exact: int8
    finally:
        for b in (raw, int8, reader):
            b.close()


def test_daemon_outage_gives_misses_not_errors(kvtier_daemon, model) -> None:
    src, dst = MHAHostPool("layer_first"), MHAHostPool("layer_first")
    fill(src, seed=9)
    hashes = page_hashes(tokens(3 * 4, seed=9), 4)
    backend = make_backend(kvtier_daemon.address, src, model=model, timeout_s=60.0)
    reader = make_backend(kvtier_daemon.address, dst, model=model, timeout_s=60.0)
    try:
        assert backend.batch_set_v1(hashes[:2], host_indices([0, 1], 4)) == [True, True]
        kvtier_daemon.stop()
        assert reader.batch_exists(hashes) == 0
        assert reader.batch_get_v1(hashes, host_indices([0, 1, 2], 4)) == [False] * 3
        assert backend.batch_set_v1(hashes, host_indices([0, 1, 2], 4)) == [False] * 3
        assert reader.get(hashes[0]) is None and not reader.exists(hashes[0])
        assert backend.batch_set(hashes, [src.get_data_page(i * 4) for i in range(3)]) is False
        assert backend.clear() is False
        kvtier_daemon.start()
        # The client fails fast for a moment after an outage (its hold-down), then reconnects.
        wait_until(lambda: reader.batch_exists(hashes) == 2, interval_s=0.1,
                   what="the restarted daemon serving the reader")  # the disk tier kept what was stored
        wait_until(lambda: backend.batch_set_v1(hashes, host_indices([0, 1, 2], 4)) == [True] * 3, interval_s=0.1,
                   what="the restarted daemon storing the backend's pages")  # its own client's hold-down too
        assert reader.batch_get_v1(hashes, host_indices([5, 6, 7], 4)) == [True] * 3
        assert torch.equal(page_tensor(dst, 7), page_tensor(src, 2))
        assert backend.clear() and reader.batch_exists(hashes) == 0
    finally:
        backend.close()
        reader.close()


def test_configuration_errors(kvtier_daemon_module, model, tmp_path: Path) -> None:
    addr = kvtier_daemon_module.address
    with pytest.raises(NamespaceError, match="revision"):
        PageBackend(StorageConfig(model_name="org/some-hub-model", extra_config={"address": addr}), {})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"weights")
    digested = PageBackend(StorageConfig(model_name=str(ckpt), extra_config={"address": addr}), {})
    assert digested.revision.startswith("sha256:")
    digested.close()
    with pytest.raises(InvalidRequest):
        PageBackend(StorageConfig(extra_config={"revision": "r", "timeout_s": "soon"}), {})
    with pytest.raises(InvalidRequest, match="accept_lossy"):
        PageBackend(StorageConfig(extra_config={"revision": "r", "accept_lossy": "false"}), {})
    exact = PageBackend(StorageConfig(extra_config={"revision": "r", "address": addr, "accept_lossy": False}), {})
    assert exact.settings.accept_lossy is False
    exact.close()
    backend = PageBackend(StorageConfig(extra_config={"revision": "r", "address": addr, "model": model}), {})
    try:
        with pytest.raises(InvalidRequest, match="register_mem_pool_host"):
            backend.batch_exists(page_hashes(tokens(4), 4))
        with pytest.raises(LayoutError):
            backend.register_mem_pool_host(MHAHostPool("layer_first", dtype=torch.float64))
        unknown = MHAHostPool("page_first")
        unknown.layout = "page_first_kv_split"
        with pytest.raises(LayoutError):
            backend.register_mem_pool_host(unknown)
    finally:
        backend.close()
    cp = PageBackend(StorageConfig(attn_cp_size=2, extra_config={"revision": "r", "address": addr}), {})
    with pytest.raises(NamespaceError, match="context-parallel"):
        cp.register_mem_pool_host(MHAHostPool("page_first"))
    cp.close()
