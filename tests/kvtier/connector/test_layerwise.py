"""Layer-wise loads and saves of KVConnectorCore against a real daemon: the same bytes as the
whole-block path in every page layout, dtype and codec; a delayed layer holds the consumer at
exactly that layer; a save never reads a page before the compute that writes it (a fake stream
clock that runs copies as early as their waits allow); staging is reused only after its copies."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvtier.connector import KVConnectorCore
from kvtier.connector.pages import gather_block
from kvtier.connector.streams import DONE, Staging, host_streams
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.connector.connkit import CASES, make_caches, make_ns, tokens
from tests.kvtier.connector.streamkit import GatedStream, StreamClock

TIMEOUT_S = 2.0
WAIT_S = 30.0


@pytest.fixture
def cores() -> Iterator[list[KVConnectorCore]]:
    made: list[KVConnectorCore] = []
    yield made
    for core in made:
        core.close()


def connect(made: list, daemon: KvtierDaemon | str, ns, layout: str = "vllm-flash", *, caches=None,
            **kwargs) -> KVConnectorCore:
    address = daemon if isinstance(daemon, str) else daemon.address
    core = KVConnectorCore(ns, address=address, page_layout=layout, timeout_s=TIMEOUT_S, **kwargs)
    made.append(core)
    if caches is not None:
        core.bind_kv_caches(caches)
    return core


def bits(core: KVConnectorCore, pages: list[int]) -> list[torch.Tensor]:
    assert core._caches is not None
    return [gather_block(core._caches, p, core.page_layout).contiguous().view(torch.uint8) for p in pages]


def load_all_layers(core: KVConnectorCore, hashes: list[bytes], pages: list[int]) -> int:
    load = core.start_load(hashes, pages)
    n = load.num_blocks(WAIT_S)
    for i in range(core.ns.num_layers):
        load.wait_layer(i, core.streams.compute, WAIT_S)
    result = load.result(WAIT_S)
    assert result.num_blocks == n
    return n


def save_all_layers(core: KVConnectorCore, hashes: list[bytes], pages: list[int], **kw) -> int:
    save = core.start_save(hashes, pages, **kw)
    job = None
    for i in range(core.ns.num_layers):
        assert job is None, "the store starts after the last layer only"
        job = save.layer_done(i)
    assert job is not None and save.layer_done(0) == job, "feeding a layer again does nothing"
    core.release_pages()
    return core.wait(job, WAIT_S).num_blocks


@pytest.mark.parametrize(("attention", "layout", "dtype"), CASES)
def test_layerwise_load_and_save_give_the_bytes_of_the_whole_block_path(
        kvtier_daemon_module: KvtierDaemon, cores: list, attention: str, layout: str, dtype: str) -> None:
    ns = make_ns(attention, kv_dtype=dtype, layers=3)
    writer = connect(cores, kvtier_daemon_module, ns, layout, caches=make_caches(ns, layout, seed=3))
    whole = connect(cores, kvtier_daemon_module, ns, layout, caches=make_caches(ns, layout, seed=None))
    layered = connect(cores, kvtier_daemon_module, ns, layout, caches=make_caches(ns, layout, seed=None))
    prompt = tokens(4 * ns.block_tokens, seed=7)
    hashes = writer.block_hashes(prompt)
    # saved layer by layer, loaded whole; then loaded layer by layer: the writer's bytes every time
    assert save_all_layers(writer, hashes[:3], [1, 3, 5], token_ids=prompt) == 3
    assert whole.load(hashes, [6, 2, 0, 7]) == 3
    assert load_all_layers(layered, hashes, [6, 2, 0, 7]) == 3
    want = bits(writer, [1, 3, 5])
    assert all(torch.equal(a, b) for a, b in zip(want, bits(whole, [6, 2, 0])))
    assert all(torch.equal(a, b) for a, b in zip(want, bits(layered, [6, 2, 0])))
    assert all(torch.equal(a, b) for a, b in zip(bits(whole, list(range(8))), bits(layered, list(range(8))))), \
        "only the loaded pages are written"
    # the records a layer-wise save stores are those of a whole-block save of the same pages
    other = make_ns(attention, kv_dtype=dtype, layers=3)
    a = connect(cores, kvtier_daemon_module, other, layout, caches=make_caches(other, layout, seed=9))
    hashes = a.block_hashes(prompt)
    assert save_all_layers(a, hashes[:2], [4, 0]) == 2
    got = a.client.load(other.ns_id, hashes[:2])
    a.client.delete(other.ns_id, hashes[:2])
    assert a.save(hashes[:2], [4, 0]) == 2
    assert a.client.load(other.ns_id, hashes[:2]) == got


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_codec_and_a_foreign_layout_load_layer_by_layer_as_whole(kvtier_daemon_module: KvtierDaemon, cores: list,
                                                                   codec: str) -> None:
    ns = make_ns("mha", codec=codec)
    writer = connect(cores, kvtier_daemon_module, ns, "vllm-nhc", caches=make_caches(ns, "vllm-nhc", seed=2))
    whole = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None))
    layered = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None))
    hashes = writer.block_hashes(tokens(2 * ns.block_tokens, seed=3))
    assert writer.save(hashes, [0, 1]) == 2
    assert whole.load(hashes, [2, 3]) == 2 and load_all_layers(layered, hashes, [2, 3]) == 2
    assert all(torch.equal(a, b) for a, b in zip(bits(whole, [2, 3]), bits(layered, [2, 3])))


def test_a_miss_or_a_daemon_down_fixes_the_count_before_any_layer(kvtier_daemon_module: KvtierDaemon, cores: list,
                                                                   tmp_path) -> None:
    ns = make_ns("mha")
    writer = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=4))
    reader = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None))
    hashes = writer.block_hashes(tokens(3 * ns.block_tokens, seed=5))
    assert writer.save(hashes[:1], [0]) == 1
    load = reader.start_load(hashes, [5, 6, 7])
    assert load.num_blocks(WAIT_S) == 1
    for i in range(ns.num_layers):
        load.wait_layer(i, reader.streams.compute, WAIT_S)
    result = load.result(WAIT_S)
    assert (result.ok, result.num_blocks) == (False, 1) and "miss at block 1" in (result.error or "")
    assert not any(b.any() for b in bits(reader, [6, 7]))
    down = connect(cores, f"unix:{tmp_path}/none.sock", ns, caches=make_caches(ns, "vllm-flash", seed=None))
    load = down.start_load(hashes[:2], [0, 1])
    assert load.num_blocks(WAIT_S) == 0
    for i in range(ns.num_layers):  # every layer released at once: nothing to wait for
        load.wait_layer(i, down.streams.compute, WAIT_S)
    assert load.result(WAIT_S).num_blocks == 0 and ("wait", 0) not in load.trace


def test_a_delayed_layer_holds_the_engine_at_exactly_that_layer(kvtier_daemon_module: KvtierDaemon,
                                                                cores: list) -> None:
    ns = make_ns("mha", layers=4)
    k = 2
    writer = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=8))
    hashes = writer.block_hashes(tokens(2 * ns.block_tokens, seed=8))
    assert writer.save(hashes, [0, 1]) == 2
    gate = GatedStream(gate_at=k)  # the load stream's op k copies layer k: it waits for the gate
    plain = host_streams()
    streams = type(plain)(plain.compute, gate, plain.save)
    reader = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None),
                     streams=streams)
    load = reader.start_load(hashes, [4, 5])
    assert load.num_blocks(WAIT_S) == 2
    consumed: list[int] = []

    def engine() -> None:
        for i in range(ns.num_layers):
            load.wait_layer(i, streams.compute, WAIT_S)
            consumed.append(i)

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        assert load.wait_waiting(k, WAIT_S), "the engine blocks on layer k"
        assert consumed == list(range(k)), "every layer before k was consumed, none after"
        assert ("ready", k) not in load.trace
    finally:
        gate.open()
        thread.join(WAIT_S)
    assert consumed == list(range(ns.num_layers))
    trace = load.trace
    assert trace.index(("wait", k)) < trace.index(("ready", k)) < trace.index(("consumed", k))
    assert all(trace.index(("ready", i)) < trace.index(("consumed", i)) < trace.index(("wait", k)) for i in range(k))
    assert all(torch.equal(a, b) for a, b in zip(bits(writer, [0, 1]), bits(reader, [4, 5])))


def test_a_save_never_reads_a_page_before_the_compute_that_writes_it(kvtier_daemon_module: KvtierDaemon,
                                                                     cores: list) -> None:
    ns = make_ns("mha", layers=3)
    clock = StreamClock()
    core = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None),
                   streams=clock.streams())
    final = make_caches(ns, "vllm-flash", seed=11)  # what the compute writes, layer by layer
    hashes = core.block_hashes(tokens(2 * ns.block_tokens, seed=11))
    pages = [3, 6]
    index = torch.tensor(pages)
    assert core._caches is not None
    save = core.start_save(hashes, pages)
    for i, (cache, src) in enumerate(zip(core._caches, final)):
        # the engine queues layer i's compute, then tells the save layer i is done
        clock.compute.run(lambda cache=cache, src=src: cache.index_copy_(1, index, src.index_select(1, index)))
        job = save.layer_done(i)
    assert job is not None
    assert save.read is not None
    core.release_pages()  # the compute waits for the save's reads before it writes pages again
    clock.compute.run(lambda: [c.zero_() for c in core._caches])  # the next step reuses the pages
    result = core.wait(job, WAIT_S)  # the store synchronizes on the reads: the clock runs
    assert result.ok and result.num_blocks == 2
    clock.drain()
    assert not any(c.any() for c in core._caches), "the reuse ran, after the reads"
    reader = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None))
    assert reader.load(hashes, pages) == 2
    want = [gather_block(final, p, core.page_layout) for p in pages]
    got = [gather_block(reader._caches, p, core.page_layout) for p in pages]  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "the save read each layer after its compute"
    # the order the clock ran: each save copy after the compute op it waits on
    saves = [n for s, n in clock.log if s == "save"]
    assert saves == sorted(saves)
    computes_before_each_copy = []
    seen = 0
    for s, _ in clock.log:
        seen += s == "compute"
        if s == "save":
            computes_before_each_copy.append(seen)
    # ops on the save stream: (wait, copy) per layer; copy of layer i after compute op i + 1
    copies = computes_before_each_copy[1::2]
    assert all(c >= i + 1 for i, c in enumerate(copies)) and len(copies) == 3


def test_a_load_waits_for_the_compute_queued_before_it(kvtier_daemon_module: KvtierDaemon, cores: list) -> None:
    ns = make_ns("mha", layers=2)
    writer = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=12))
    hashes = writer.block_hashes(tokens(ns.block_tokens, seed=12))
    assert writer.save(hashes, [2]) == 1
    clock = StreamClock()
    reader = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None),
                     streams=clock.streams())
    assert reader._caches is not None
    # the previous step's compute, still queued, writes page 4 (a page the load then fills)
    clock.compute.run(lambda: [c[:, 4].fill_(7.0) for c in reader._caches])
    load = reader.start_load(hashes, [4])
    assert load.num_blocks(WAIT_S) == 1
    for i in range(ns.num_layers):
        load.wait_layer(i, clock.compute, WAIT_S)
    load.result(WAIT_S)
    clock.drain()
    assert all(torch.equal(a, b) for a, b in zip(bits(writer, [2]), bits(reader, [4]))), \
        "the load's copies ran after the compute queued before it"


def test_staging_is_reused_only_after_its_last_copy() -> None:
    clock = StreamClock()
    staging = Staging(pinned=False)
    buf = staging.take(100)
    ran: list[str] = []
    clock.save.run(lambda: ran.append("copy"))
    staging.give_back(buf, clock.save.record_event())
    assert ran == []
    again = staging.take(64)
    assert again.data_ptr() == buf.data_ptr() and ran == ["copy"], "handed out after the copy ran"
    staging.give_back(again, DONE)
    bigger = staging.take(1000)
    assert bigger.numel() >= 1000 and staging.allocated_bytes == 1100


# --- CUDA: dedicated copy streams, pinned staging, events (skipped without a GPU) -----------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("attention", "layout"), [("mha", "vllm-flash"), ("mha", "vllm-nhc"), ("mla", "mla-latent")])
def test_cuda_layerwise_load_and_save_equal_the_whole_block_path(kvtier_daemon_module: KvtierDaemon, cores: list,
                                                                 attention: str, layout: str) -> None:
    ns = make_ns(attention, kv_dtype="bfloat16", block_tokens=16, layers=4)
    writer = connect(cores, kvtier_daemon_module, ns, layout, caches=make_caches(ns, layout, seed=14, device="cuda"))
    whole = connect(cores, kvtier_daemon_module, ns, layout, caches=make_caches(ns, layout, seed=None, device="cuda"))
    layered = connect(cores, kvtier_daemon_module, ns, layout,
                      caches=make_caches(ns, layout, seed=None, device="cuda"))
    assert layered.streams.on_cuda and layered._staging.pinned
    hashes = writer.block_hashes(tokens(3 * ns.block_tokens, seed=12))
    assert save_all_layers(writer, hashes, [0, 2, 4]) == 3
    assert whole.load(hashes, [5, 3, 1]) == 3 and load_all_layers(layered, hashes, [5, 3, 1]) == 3
    torch.cuda.synchronize()
    want = bits(writer, [0, 2, 4])
    assert all(torch.equal(a, b) for a, b in zip(want, bits(whole, [5, 3, 1])))
    assert all(torch.equal(a, b) for a, b in zip(want, bits(layered, [5, 3, 1])))
    staged = layered._staging.allocated_bytes
    assert load_all_layers(layered, hashes, [5, 3, 1]) == 3 and layered._staging.allocated_bytes == staged, \
        "pinned staging is allocated once and reused"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_save_reads_pages_after_the_compute_that_writes_them(kvtier_daemon_module: KvtierDaemon,
                                                                   cores: list) -> None:
    ns = make_ns("mha", kv_dtype="bfloat16", block_tokens=16, layers=2)
    core = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None, device="cuda"))
    final = make_caches(ns, "vllm-flash", seed=21, device="cuda")
    hashes = core.block_hashes(tokens(2 * ns.block_tokens, seed=21))
    index = torch.tensor([1, 6], device="cuda")
    assert core._caches is not None
    save = core.start_save(hashes, [1, 6])
    for i, (cache, src) in enumerate(zip(core._caches, final)):
        torch.cuda._sleep(50_000_000)  # the compute stream is busy a while before it writes layer i
        cache.index_copy_(1, index, src.index_select(1, index))
        job = save.layer_done(i)
    core.release_pages()
    for cache in core._caches:  # the next step reuses the pages: after the save's reads
        cache.zero_()
    assert job is not None and core.wait(job, WAIT_S).num_blocks == 2
    reader = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None, device="cuda"))
    assert reader.load(hashes, [1, 6]) == 2
    torch.cuda.synchronize()
    assert all(torch.equal(gather_block(final, p, core.page_layout), gather_block(reader._caches, p, core.page_layout))
               for p in (1, 6))
