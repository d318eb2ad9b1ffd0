"""KVTierConnector's layer-wise path in vLLM's call order (vllmkit's MiniEngine, a real daemon):
``start_load_kv`` / ``wait_for_layer_load`` / ``save_kv_layer`` / ``wait_for_save`` give the
pages and records of the whole-block path, and a delayed layer holds the forward at that layer."""

from __future__ import annotations

import secrets
import threading

import pytest
import torch

from kvtier.client import Client
from kvtier.connector.streams import Streams, host_streams
from tests.connectors.kvtier_vllm.vllmkit import BLOCK, LAYERS, LAYOUTS, KvtierDaemon, MiniEngine, Request
from tests.kvtier.connector.streamkit import GatedStream

WAIT_S = 30.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = KvtierDaemon(tmp_path_factory.mktemp("kvtierd"))
    try:
        yield d.start()
    finally:
        d.cleanup()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def produce(eng: MiniEngine, prompt: list[int], req_id: str) -> dict[int, list[torch.Tensor]]:
    """Run ``prompt`` on ``eng`` until its blocks are stored; the saved pages by block."""
    req = eng.add(Request(req_id, prompt))
    eng.run_until_idle()
    pages = {j: [p.clone() for p in eng.layer_pages(req.block_ids[j])] for j in range(len(prompt) // BLOCK)}
    eng.finish(req)
    eng.settle()
    assert not eng.held
    return pages


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layerwise_pages_and_records_equal_the_whole_block_path(daemon, layout):
    model = f"test-{secrets.token_hex(6)}"
    writer = MiniEngine(daemon.address, layout, model=model, load_mode="sync")  # saves layer by layer
    whole = MiniEngine(daemon.address, layout, model=model, load_mode="sync", layerwise=False)
    layered = MiniEngine(daemon.address, layout, model=model, load_mode="sync")
    try:
        prompt = tokens(5 * BLOCK + 1, seed=3)
        saved = produce(writer, prompt, "w")
        assert writer.worker.worker.core._staging.allocated_bytes > 0, "the writer saved through save_kv_layer"
        got = {}
        for name, eng in (("whole", whole), ("layered", layered)):
            req = eng.add(Request(name, prompt))
            eng.run_until_idle()
            assert eng.matched[name] == 5 * BLOCK and not eng.invalid
            got[name] = {j: eng.layer_pages(req.block_ids[j]) for j in range(5)}
        for j in range(5):
            for a, b, c in zip(saved[j], got["whole"][j], got["layered"][j]):
                assert torch.equal(a, b) and torch.equal(a, c), f"block {j}"
        # the records the layer-wise writer stored are those a whole-block writer stores
        ns = writer.worker.worker.ns
        req_hashes = Request("x", prompt).block_hashes[:5]
        with Client.connect(daemon.address) as client:
            layered_records = client.load(ns.ns_id, req_hashes)
            assert len(layered_records) == 5
            client.delete(ns.ns_id, req_hashes)
            other = MiniEngine(daemon.address, layout, model=model, load_mode="sync", layerwise=False)
            try:
                produce(other, prompt, "o")
            finally:
                other.close()
            assert client.load(ns.ns_id, req_hashes) == layered_records
    finally:
        for eng in (writer, whole, layered):
            eng.close()


def test_a_delayed_layer_holds_the_forward_at_that_layer(daemon):
    model = f"test-{secrets.token_hex(6)}"
    writer = MiniEngine(daemon.address, "v033-lbnhc", model=model, load_mode="sync")
    reader = MiniEngine(daemon.address, "v033-lbnhc", model=model, load_mode="sync")
    try:
        prompt = tokens(4 * BLOCK + 1, seed=4)
        saved = produce(writer, prompt, "w")
        k = LAYERS - 1
        gate = GatedStream(gate_at=k)  # the load stream's op k copies layer k
        core = reader.worker.worker.core
        assert core is not None
        plain = host_streams()
        core.streams = Streams(plain.compute, gate, plain.save)
        req = reader.add(Request("r", prompt))
        thread = threading.Thread(target=reader.step)
        thread.start()
        try:
            assert gate.reached.wait(WAIT_S)
            loads = reader.worker.worker._step_loads
            assert len(loads) == 1
            load = loads[0][1]
            assert load.wait_waiting(k, WAIT_S), "the forward waits on layer k"
            assert reader.layer_log == [e for i in range(k) for e in (("enter", i), ("exit", i))]
        finally:
            gate.open()
            thread.join(WAIT_S)
        assert reader.layer_log[-2:] == [("enter", k), ("exit", k)]
        trace = load.trace
        assert trace.index(("wait", k)) < trace.index(("ready", k)) < trace.index(("consumed", k))
        assert not reader.invalid
        for j in range(4):
            assert all(torch.equal(a, b) for a, b in zip(saved[j], reader.layer_pages(req.block_ids[j])))
    finally:
        writer.close()
        reader.close()
