"""The reference engine's layer-wise loads and saves through a real daemon: the same KV bytes and
``torch.equal`` logits as the whole-block path, on full and partial hits, MHA and MLA; a delay
injected on one layer's copy holds the forward at exactly that layer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.connector import KVConnectorCore, namespace_for_checkpoint
from kvtier.connector.streams import Streams, host_streams
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.checkpoint import make_random_checkpoint
from kvtier.engine.config import ModelConfig
from tests.kvtier.connector.streamkit import GatedStream

TIMEOUT_S = 60.0
MHA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
MLA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                  num_kv_heads=4, head_dim=24, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024)
GEN = SamplingParams(max_tokens=8, keep_logits=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pages_of(engine: Engine, out_tokens: list[int]) -> list[torch.Tensor]:
    """The KV bytes of the engine's pages that hold ``out_tokens``' full blocks."""
    hashes = engine._block_hashes(out_tokens)
    pages = [engine.allocator.page_of(h) for h in hashes]
    assert all(p is not None for p in pages)
    axis = 0 if engine.model.config.is_mla else 1
    return [torch.stack([c.select(axis, p) for c in engine.kv_cache.layers]).view(torch.uint8) for p in pages]


@pytest.mark.parametrize("cfg", [MHA, MLA], ids=["mha", "mla"])
def test_layerwise_hits_equal_whole_block_hits(cfg: ModelConfig, kvtier_daemon, tmp_path: Path) -> None:
    make_random_checkpoint(tmp_path / "model", cfg, seed=0)
    address = kvtier_daemon.address
    kw = dict(num_pages=64, kvtier_address=address, timeout_s=TIMEOUT_S)
    full = prompt(96, 1)
    half = full[:48] + prompt(48, 2)  # a partial hit: the first 48 tokens (3 blocks) stored
    with Engine(tmp_path / "model", layerwise=True, **kw) as writer:
        ref = writer.generate([full], GEN)[0]  # saved layer by layer
        assert ref.loaded_tokens == 0 and writer.stats.saved_blocks == 6
    results = {}
    for layerwise in (False, True):
        with Engine(tmp_path / "model", layerwise=layerwise, **kw) as engine:
            hit = engine.generate([full], GEN)[0]
            hit_pages = pages_of(engine, full[:80])
            engine.reset_prefix_cache()  # the partial hit loads its prefix from kvtier too
            partial = engine.generate([half], GEN)[0]
            assert hit.loaded_tokens == 80 and partial.loaded_tokens == 48
            results[layerwise] = (hit, partial, hit_pages, pages_of(engine, half[:48]))
            assert engine.connector is not None  # the partial hit saved its suffix: forget it for the next round
            engine.connector.client.delete(engine.connector.ns.ns_id, engine._block_hashes(half)[3:])
    whole, layered = results[False], results[True]
    for a, b in zip(whole[:2], layered[:2]):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.first_logits, b.first_logits) and torch.equal(a.logits, b.logits)
    assert torch.equal(ref.first_logits, layered[0].first_logits), "a layer-wise hit gives the recompute's logits"
    for a, b in zip(whole[2] + whole[3], layered[2] + layered[3]):
        assert torch.equal(a, b), "the loaded pages hold the same bytes"
    # the blocks the layer-wise writer saved are the ones a whole-block writer stores
    with Engine(tmp_path / "model", num_pages=64, layerwise=False) as plain:
        plain.generate([full], SamplingParams(max_tokens=1))
        for a, b in zip(pages_of(plain, full[:80]), layered[2]):
            assert torch.equal(a, b)


def test_a_delayed_layer_holds_the_forward_at_exactly_that_layer(kvtier_daemon, tmp_path: Path) -> None:
    make_random_checkpoint(tmp_path / "model", MHA, seed=3)
    address = kvtier_daemon.address
    p = prompt(64, 5)
    with Engine(tmp_path / "model", num_pages=32, kvtier_address=address, timeout_s=TIMEOUT_S) as writer:
        ref = writer.generate([p], SamplingParams(max_tokens=1))[0]
    k = 1
    gate = GatedStream(gate_at=k)  # the load stream's op k is layer k's copy
    plain = host_streams()
    ns = namespace_for_checkpoint(tmp_path / "model", kv_dtype=torch.float32, block_tokens=16)
    core = KVConnectorCore(ns, address=address, page_layout="vllm-flash", timeout_s=TIMEOUT_S,
                           streams=Streams(plain.compute, gate, plain.save))
    ran: list[int] = []
    handles: list = []
    captured = threading.Event()
    start_load = core.start_load

    def capture(*args, **kw):  # the engine's load handle, for the test to watch
        handles.append(start_load(*args, **kw))
        captured.set()
        return handles[-1]

    core.start_load = capture  # type: ignore[method-assign]
    try:
        with Engine(tmp_path / "model", num_pages=32, connector=core) as engine:
            for i, layer in enumerate(engine.model.model.layers):
                layer.register_forward_hook(lambda *_, i=i: ran.append(i))
            engine.add_request(p, SamplingParams(max_tokens=1))
            outs: list = []
            thread = threading.Thread(target=lambda: outs.extend(engine.step()))
            thread.start()
            try:
                assert gate.reached.wait(TIMEOUT_S), "the load reached layer k's copy"
                assert captured.wait(TIMEOUT_S)
                load = handles[0]
                assert load.wait_waiting(k, TIMEOUT_S), "the forward waits on layer k"
                assert ran == list(range(k)), "layers before k ran, none from k on"
            finally:
                gate.open()
                thread.join(TIMEOUT_S)
            assert ran == list(range(MHA.num_layers)) and len(outs) == 1
            trace = load.trace
            assert all(trace.index(("consumed", i)) < trace.index(("wait", k)) for i in range(k))
            assert trace.index(("wait", k)) < trace.index(("ready", k)) < trace.index(("consumed", k))
            assert outs[0].loaded_tokens == 48 and torch.equal(outs[0].first_logits, ref.first_logits)
    finally:
        core.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_layerwise_partial_hit_equals_whole_block(kvtier_daemon, tmp_path: Path) -> None:
    make_random_checkpoint(tmp_path / "model", MHA, seed=0)
    kw = dict(device="cuda", num_pages=64, kvtier_address=kvtier_daemon.address, timeout_s=TIMEOUT_S)
    prefix = prompt(48, 1)
    with Engine(tmp_path / "model", **kw) as writer:
        writer.generate([prefix], SamplingParams(max_tokens=1))
        assert writer.stats.saved_blocks == 3
    outs = []
    for layerwise in (True, False):
        with Engine(tmp_path / "model", layerwise=layerwise, **kw) as engine:
            assert engine.connector is not None and engine.connector.streams.on_cuda
            p = prefix + prompt(48, 9)
            outs.append(engine.generate([p], GEN)[0])
            engine.connector.client.delete(engine.connector.ns.ns_id, engine._block_hashes(p)[3:])
    assert outs[0].loaded_tokens == outs[1].loaded_tokens == 48
    assert torch.equal(outs[0].first_logits, outs[1].first_logits) and outs[0].token_ids == outs[1].token_ids
