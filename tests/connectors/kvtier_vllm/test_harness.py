"""KVTierConnector driven through vLLM's call order (engine-interfaces.md §1.4) against a real daemon,
with CPU caches in vLLM 0.33's strided [B, H, N, C] views (LBNHC and LBHNC), MLA, and the legacy
(2, B, N, H, D) layout. No vLLM needed: vllmkit plays the engine."""

from __future__ import annotations

import secrets

import pytest
import torch

from kvtier_protocol.keys import ExtraKeys, NONE_HASH, block_keys, chain_hashes
from kvtier_protocol.errors import InvalidRequest, LayoutError

from kvtier.client import Client

from tests.connectors.kvtier_vllm.vllmkit import (BLOCK, LAYOUTS, KvtierDaemon, MiniEngine, Request,
                                                   kv_cache_config, make_caches, token_kv)
from tests.kvtier.waitkit import PATIENCE_S


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = KvtierDaemon(tmp_path_factory.mktemp("kvtierd"))
    try:
        yield d.start()
    finally:
        d.cleanup()


@pytest.fixture
def own_daemon(tmp_path):
    d = KvtierDaemon(tmp_path)
    try:
        yield d.start()
    finally:
        d.cleanup()


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()


def engines(address: str, layout: str, **extra):
    """Two engines of one model (one namespace): a producer and a consumer."""
    model = f"test-{secrets.token_hex(6)}"
    return MiniEngine(address, layout, model=model, **extra), MiniEngine(address, layout, model=model, **extra)


@pytest.mark.parametrize("load_mode", ["async", "sync"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loaded_pages_equal_saved_pages(daemon, layout, load_mode):
    a, b = engines(daemon.address, layout, load_mode=load_mode)
    try:
        prompt = tokens(6 * BLOCK + 2, seed=1)
        ra = a.add(Request("a", prompt))
        a.run_until_idle()
        saved = {j: a.layer_pages(ra.block_ids[j]) for j in range(6)}
        a.finish(ra)
        a.settle()
        assert not a.held and not a.sched.scheduler.has_pending_saves()

        rb = b.add(Request("b", prompt))
        b.step()  # lookup: 6 full blocks, the last prompt token is left to compute
        assert b.matched["b"] == 6 * BLOCK
        b.run_until_idle()
        assert not b.invalid
        for j in range(6):
            for got, want in zip(b.layer_pages(rb.block_ids[j]), saved[j]):
                assert torch.equal(got, want), f"block {j} differs after load"
        assert rb.num_computed_tokens == rb.num_tokens
    finally:
        a.close()
        b.close()


def test_finished_request_keeps_blocks_until_saves_complete(own_daemon):
    eng = MiniEngine(own_daemon.address, "v033-lbnhc")  # the save waits on the paused daemon, not its timeout
    try:
        req = eng.add(Request("r", tokens(5 * BLOCK + 1, seed=2)))
        own_daemon.pause()  # the save job blocks on the silent daemon
        eng.step()  # prefill: the scheduler plans a save of 5 blocks, the worker queues it
        assert eng.finish(req) is True  # the save is in flight: vLLM must keep the blocks
        blocks = list(eng.held["r"].block_ids)
        for _ in range(3):
            out = eng.step()
            assert not out.finished_sending
            assert "r" in eng.held and not set(blocks) & set(eng.free)
        assert eng.sched.has_pending_block_frees()
        own_daemon.resume()
        eng.worker.worker.wait_idle(PATIENCE_S)
        out = eng.step()
        assert out.finished_sending == {"r"}
        assert not eng.held and set(blocks) <= set(eng.free)
        keys = block_keys(req.block_hashes, 1)[:5]
        ns = eng.worker.worker.ns
        with Client(own_daemon.address) as client:
            assert client.lookup(ns.ns_id, keys).num_hits == 5
    finally:
        if own_daemon.process is not None:
            own_daemon.resume()
        eng.close()


def test_request_without_saves_is_freed_at_once(daemon):
    eng = MiniEngine(daemon.address, "v033-lbnhc")
    try:
        req = eng.add(Request("short", tokens(BLOCK - 1, seed=3)))  # no full block: nothing to save
        eng.run_until_idle()
        assert eng.finish(req) is False
    finally:
        eng.close()


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_daemon_outage_mid_load_reports_block_ids(own_daemon, load_mode):
    a, b = engines(own_daemon.address, "v033-lbnhc", load_mode=load_mode)  # the stopped daemon refuses at once
    try:
        prompt = tokens(4 * BLOCK + 3, seed=4)
        ra = a.add(Request("a", prompt))
        a.run_until_idle()
        a.finish(ra)
        a.settle()

        rb = b.add(Request("b", prompt))
        b.before_worker = own_daemon.stop  # the scheduler saw 4 blocks; the daemon dies before the load
        b.run_until_idle()
        assert b.matched["b"] == 4 * BLOCK
        assert b.invalid == set(rb.block_ids[:4])  # vLLM recomputes exactly these
        assert rb.num_computed_tokens == rb.num_tokens
        for j in range(4):  # recomputed, not left as the failed load left them
            for layer, got in enumerate(b.layer_pages(rb.block_ids[j])):
                pos = j * BLOCK
                want = token_kv(prompt, pos, layer, (2, 16))
                assert torch.equal(got[:, 0] if got.dim() == 3 else got[0], want)
    finally:
        a.close()
        b.close()


def test_matched_tokens_are_block_aligned_and_leave_the_last_token(daemon):
    a, b = engines(daemon.address, "v033-lbnhc")
    try:
        prompt = tokens(8 * BLOCK, seed=5)
        ra = a.add(Request("a", prompt))
        a.run_until_idle()
        a.finish(ra)
        a.settle()
        s = b.sched
        exact = Request("x", prompt)  # 8 full blocks stored; the 8th holds the last token
        assert s.get_num_new_matched_tokens(exact, 0) == (7 * BLOCK, True)
        assert s.get_num_new_matched_tokens(exact, 0) == (7 * BLOCK, True)  # no side effects: same answer
        assert s.get_num_new_matched_tokens(exact, 2 * BLOCK) == (5 * BLOCK, True)  # beyond the local hit
        assert s.get_num_new_matched_tokens(exact, 7 * BLOCK) == (0, False)
        longer = Request("y", prompt + [1, 2, 3])
        assert s.get_num_new_matched_tokens(longer, 0) == (8 * BLOCK, True)
        diverged = Request("z", prompt[:3 * BLOCK] + [7] + prompt[3 * BLOCK + 1:])
        assert s.get_num_new_matched_tokens(diverged, 0) == (3 * BLOCK, True)
        assert s.get_num_new_matched_tokens(Request("w", tokens(9, seed=99)), 0) == (0, False)
    finally:
        a.close()
        b.close()


def test_uses_the_requests_own_block_hashes(daemon):
    """A LoRA request's vLLM hashes carry the adapter; blocks are stored under those, not token-only keys."""
    a, b = engines(daemon.address, "v033-lbnhc")
    try:
        prompt = tokens(3 * BLOCK + 1, seed=6)
        lora = ExtraKeys(lora_name="adapter", lora_path="/a")
        ra = a.add(Request("a", prompt, extras=lora))
        a.run_until_idle()
        a.finish(ra)
        a.settle()
        ns = a.worker.worker.ns
        with Client(daemon.address) as client:
            assert client.lookup(ns.ns_id, ra.block_hashes[:3]).num_hits == 3
            assert client.lookup(ns.ns_id, chain_hashes(prompt, BLOCK)[:3]).num_hits == 0
        assert b.sched.get_num_new_matched_tokens(Request("plain", prompt), 0) == (0, False)
        assert b.sched.get_num_new_matched_tokens(Request("lora", prompt, extras=lora), 0) == (3 * BLOCK, True)
    finally:
        a.close()
        b.close()


def test_kv_events_are_emitted_for_completed_saves(daemon):
    eng = MiniEngine(daemon.address, "v033-lbnhc", kv_events=True)
    try:
        req = eng.add(Request("e", tokens(2 * BLOCK + 1, seed=7)))
        eng.run_until_idle()
        eng.settle()
        (event,) = eng.events
        fields = event if isinstance(event, dict) else {f: getattr(event, f) for f in event.__struct_fields__}
        assert fields["block_hashes"] == [int.from_bytes(h[-8:], "big") for h in req.block_hashes[:2]]
        assert fields["parent_block_hash"] is None and fields["medium"] == "CPU"
        assert fields["token_ids"] == req.prompt_token_ids[:2 * BLOCK] and fields["block_size"] == BLOCK
        assert req.block_hashes[0] != NONE_HASH
    finally:
        eng.close()


def test_bad_settings_and_layouts_are_refused(daemon):
    with pytest.raises(InvalidRequest, match="unknown"):
        MiniEngine(daemon.address, "v033-lbnhc", adress="typo")
    with pytest.raises(InvalidRequest, match="load_mode"):
        MiniEngine(daemon.address, "v033-lbnhc", load_mode="later")
    with pytest.raises(InvalidRequest, match="accept_lossy"):
        MiniEngine(daemon.address, "v033-lbnhc", accept_lossy="no")
    exact = MiniEngine(daemon.address, "v033-lbnhc", accept_lossy=False)
    try:
        # the scheduler's lookups and the worker's loads ask for exact copies
        assert exact.sched.scheduler.cores[0].accept_lossy is False and exact.worker.worker.core.accept_lossy is False
    finally:
        exact.close()
    eng = MiniEngine(daemon.address, "v033-lbnhc")
    try:
        wrong = make_caches("legacy-flash")
        bad = {name: t[:, :, :, :1] for name, t in wrong.items()}  # one head instead of two
        with pytest.raises(LayoutError):
            eng.worker.register_kv_caches(bad)
        kvc = kv_cache_config("v033-lbnhc")
        assert len(kvc.kv_cache_groups) == 1
    finally:
        eng.close()
