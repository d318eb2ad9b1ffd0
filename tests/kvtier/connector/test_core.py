"""KVConnectorCore against a real daemon: exact round trips in every page layout and dtype, prefix
lookups, skipping stored blocks, codecs, layout conversion, and degrading to recompute when the
daemon is down, stopped (SIGSTOP) or restarted."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
import torch

from kvtier.client import Client
from kvtier.connector import KVConnectorCore
from kvtier.connector.pages import gather_block
from kvtier_protocol.block import encode_block
from kvtier_protocol.errors import InvalidRequest, LayoutError, Unavailable
from kvtier_protocol.header import split_record
from kvtier_protocol.layouts import convert
from tests.kvtier.client.clientkit import short_timeout
from tests.kvtier.client.peer import Peer
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.connector.connkit import CASES, make_caches, make_ns, tokens
from tests.kvtier.waitkit import ManualClock

# Calls that must succeed get a timeout no busy machine comes near (a daemon just restarted on a
# loaded machine may take seconds to answer); calls meant to time out run under short_timeout,
# against a daemon the test stopped.
TIMEOUT_S = 60.0
HOLDDOWN_S = 5.0


@pytest.fixture
def cores() -> Iterator[list[KVConnectorCore | Client]]:
    """Cores (and clients) made by a test, closed at teardown."""
    made: list[KVConnectorCore | Client] = []
    yield made
    for core in made:
        core.close()


def connect(made: list[KVConnectorCore | Client], daemon: KvtierDaemon | str, ns, layout: str = "vllm-flash", *,
            caches=None, clock: ManualClock | None = None, **kwargs) -> KVConnectorCore:
    """A core on ``daemon``; with ``clock``, on a client of its own whose hold-down
    (``HOLDDOWN_S``) that clock measures."""
    address = daemon if isinstance(daemon, str) else daemon.address
    if clock is None:
        core = KVConnectorCore(ns, address=address, page_layout=layout, timeout_s=TIMEOUT_S, **kwargs)
    else:
        client = Client(address, timeout_s=TIMEOUT_S, holddown_s=HOLDDOWN_S, clock=clock,
                        client_name="kvtier.connector", **kwargs)
        made.append(client)
        core = KVConnectorCore(ns, client=client, page_layout=layout)
    made.append(core)
    if caches is not None:
        core.bind_kv_caches(caches)
    return core


def blocks_of(core: KVConnectorCore, pages: list[int]) -> list[torch.Tensor]:
    assert core._caches is not None
    return [gather_block(core._caches, p, core.page_layout) for p in pages]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(("attention", "layout", "dtype"), CASES)
def test_save_then_load_into_other_pages_is_bit_identical(kvtier_daemon_module: KvtierDaemon, cores: list,
                                                          attention: str, layout: str, dtype: str) -> None:
    ns = make_ns(attention, kv_dtype=dtype)
    writer = connect(cores, kvtier_daemon_module, ns, layout, caches=make_caches(ns, layout, seed=3))
    reader = connect(cores, kvtier_daemon_module, ns, layout, caches=make_caches(ns, layout, seed=None))
    prompt = tokens(3 * ns.block_tokens + 2)
    hashes = writer.block_hashes(prompt)
    assert len(hashes) == 3 and hashes == ns.block_keys(prompt)
    assert reader.lookup(hashes) == 0
    assert writer.save(hashes, [1, 3, 5], token_ids=prompt) == 3
    assert reader.lookup(hashes) == 3
    assert reader.load(hashes, [6, 2, 0]) == 3
    assert reader.client.session is not None and reader.client.session.shm is not None, "the shared-memory path"
    for want, got in zip(blocks_of(writer, [1, 3, 5]), blocks_of(reader, [6, 2, 0])):
        assert torch.equal(bits(want), bits(got))
    assert not any(b.any() for b in blocks_of(reader, [1, 3, 4, 5, 7])), "only the target pages are written"
    assert writer.save(hashes, [1, 3, 5]) == 0 and writer.stats.skipped_blocks == 3
    assert (reader.stats.lookups, reader.stats.lookup_hits, reader.stats.loaded_blocks) == (2, 3, 3)
    assert writer.stats.take() == {"lookups": 0, "lookup_hits": 0, "loaded_blocks": 0, "saved_blocks": 3,
                                   "skipped_blocks": 3, "failed_calls": 0}
    assert writer.stats.take()["saved_blocks"] == 0


def test_a_partial_prefix_loads_up_to_the_first_miss(kvtier_daemon_module: KvtierDaemon, cores: list) -> None:
    ns = make_ns("mha")
    writer = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=4))
    reader = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=None))
    hashes = writer.block_hashes(tokens(4 * ns.block_tokens, seed=1))
    assert writer.save(hashes[:2], [0, 1]) == 2
    assert reader.lookup(hashes) == 2
    assert reader.lookup([hashes[2], hashes[0]]) == 0, "lookup counts leading hits only"
    assert reader.load(hashes, [4, 5, 6, 7]) == 2
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(writer, [0, 1]), blocks_of(reader, [4, 5])))
    assert not any(b.any() for b in blocks_of(reader, [6, 7]))
    # saving the whole prefix later stores only the missing blocks, chained to the stored ones
    assert writer.save(hashes, [0, 1, 2, 3]) == 2 and writer.stats.skipped_blocks == 2
    assert reader.load(hashes, [4, 5, 6, 7]) == 4
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(writer, [0, 1, 2, 3]), blocks_of(reader, [4, 5, 6, 7])))


def test_continuing_a_chain_and_unit_hashes(kvtier_daemon_module: KvtierDaemon, cores: list) -> None:
    ns = make_ns("mha", block_tokens=8, hash_tokens=4)  # two hash units per block: unit hashes are sent
    core = connect(cores, kvtier_daemon_module, ns, caches=make_caches(ns, "vllm-flash", seed=5))
    prompt = tokens(3 * ns.block_tokens, seed=2)
    hashes = core.block_hashes(prompt)
    assert core.save(hashes[:1], [0], token_ids=prompt) == 1
    assert core.save(hashes[1:], [1, 2], token_ids=prompt[ns.block_tokens:], parent=hashes[0]) == 2
    assert core.lookup(hashes) == 3
    with pytest.raises(InvalidRequest, match="token ids"):
        core.save(hashes, [0, 1, 2], token_ids=prompt[:-1])


def test_layouts_convert_on_load_within_a_namespace(kvtier_daemon_module: KvtierDaemon, cores: list) -> None:
    ns = make_ns("mha", kv_dtype="bfloat16")
    flash = connect(cores, kvtier_daemon_module, ns, "vllm-flash", caches=make_caches(ns, "vllm-flash", seed=6))
    nhc = connect(cores, kvtier_daemon_module, ns, "vllm-nhc", caches=make_caches(ns, "vllm-nhc", seed=None))
    hashes = flash.block_hashes(tokens(2 * ns.block_tokens, seed=3))
    assert flash.save(hashes, [2, 4]) == 2
    assert nhc.load(hashes, [0, 1]) == 2
    for a, b in zip(blocks_of(flash, [2, 4]), blocks_of(nhc, [0, 1])):
        assert torch.equal(convert(a, "vllm-flash", "vllm-nhc"), b)
    fetched = nhc.fetch(hashes, layout="canonical")
    assert len(fetched) == 2
    assert all(torch.equal(f, convert(a, "vllm-flash", "canonical")) for f, a in zip(fetched, blocks_of(flash, [2, 4])))


def test_store_and_fetch_block_tensors(kvtier_daemon_module: KvtierDaemon, cores: list) -> None:
    ns = make_ns("mla", kv_dtype="bfloat16")
    core = connect(cores, kvtier_daemon_module, ns, "mla-latent")  # no pages bound: tensors only
    hashes = core.block_hashes(tokens(3 * ns.block_tokens, seed=4))
    g = torch.Generator().manual_seed(7)
    blocks = [torch.randn(ns.num_layers, ns.block_tokens, 16, generator=g).to(torch.bfloat16) for _ in hashes]
    assert core.store(hashes[:2], blocks[:2], layout="mla-latent") == 2
    assert core.store(hashes, blocks, layout="mla-latent") == 1
    got = core.fetch(hashes, layout="sglang-mla-page-first")
    assert len(got) == 3
    assert all(torch.equal(g, convert(b, "mla-latent", "sglang-mla-page-first")) for g, b in zip(got, blocks))
    partial = core.fetch([hashes[0], bytes(32), hashes[2]])  # default layout: the canonical mla-latent
    assert len(partial) == 1 and torch.equal(partial[0], blocks[0])
    with pytest.raises(LayoutError):
        core.store(hashes, blocks, layout="canonical")
    with pytest.raises(InvalidRequest, match="tensors"):
        core.store(hashes, blocks[:1], layout="mla-latent")


def test_fetch_into_copies_raw_blocks_and_decodes_other_layouts(kvtier_daemon_module: KvtierDaemon,
                                                                cores: list) -> None:
    ns = make_ns("mha", kv_dtype="bfloat16")
    tensors = connect(cores, kvtier_daemon_module, ns, "vllm-flash")  # no pages: stores canonical tensors
    flash = connect(cores, kvtier_daemon_module, ns, "vllm-flash", caches=make_caches(ns, "vllm-flash", seed=21))
    hashes = tensors.block_hashes(tokens(5 * ns.block_tokens, seed=22))
    g = torch.Generator().manual_seed(23)
    canonical = [torch.randn(ns.num_layers, 2, ns.num_kv_heads, ns.block_tokens, ns.head_dim,
                             generator=g).to(torch.bfloat16) for _ in range(2)]
    assert tensors.store(hashes[:2], canonical, layout="canonical") == 2
    assert flash.save(hashes[2:4], [3, 5], parent=hashes[1]) == 2  # stored in the engine's own layout
    want = canonical + [convert(b, "vllm-flash", "canonical") for b in blocks_of(flash, [3, 5])]
    out = torch.zeros((len(hashes), *want[0].shape), dtype=torch.bfloat16)
    assert tensors.fetch_into(hashes, out) == 4, "the fifth block was never stored"
    assert all(torch.equal(out[i], w) for i, w in enumerate(want))
    assert not out[4].any()
    assert tensors.fetch_into(hashes[:2], out[:2].clone()) == 2
    with pytest.raises(InvalidRequest, match="contiguous CPU"):
        tensors.fetch_into(hashes, out.float())
    with pytest.raises(InvalidRequest, match="contiguous CPU"):
        tensors.fetch_into(hashes[:2], out)


def test_lz4_compressed_raw_blocks_load_exactly(kvtier_daemon_module: KvtierDaemon, cores: list) -> None:
    # Another writer stored raw blocks with the lz4 stage (SPEC 4.8): every way of loading them
    # decompresses and lands the same bytes as an uncompressed copy would (they were a miss).
    ns = make_ns("mha", kv_dtype="bfloat16")
    writer = connect(cores, kvtier_daemon_module, ns, "vllm-flash", caches=make_caches(ns, "vllm-flash", seed=41))
    reader = connect(cores, kvtier_daemon_module, ns, "vllm-flash", caches=make_caches(ns, "vllm-flash", seed=None))
    hashes = writer.block_hashes(tokens(3 * ns.block_tokens, seed=42))
    want = blocks_of(writer, [0, 1, 2])
    records = [(hashes[i], encode_block(want[i], ns_id=ns.ns_id, chain_hash=hashes[i],
                                        parent_hash=hashes[i - 1] if i else None, layout="vllm-flash",
                                        compression="lz4")) for i in range(3)]
    assert split_record(records[0][1])[0].compression is not None
    assert writer.client.save(ns.ns_id, records) == ["stored"] * 3
    assert reader.load(hashes, [4, 5, 6]) == 3
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(reader, [4, 5, 6]), want))
    canonical = [convert(b, "vllm-flash", "canonical") for b in want]
    assert all(torch.equal(a, b) for a, b in zip(reader.fetch(hashes), canonical))
    out = torch.zeros((3, *canonical[0].shape), dtype=torch.bfloat16)
    assert reader.fetch_into(hashes, out) == 3 and all(torch.equal(out[i], canonical[i]) for i in range(3))


def test_an_exact_only_core_misses_what_a_lossy_disk_tier_reencoded(tmp_path, cores: list) -> None:
    # A daemon whose disk tier keeps int8 (issue 25): blocks the 4 MiB host tier evicts come back
    # int8. The default core takes them (within int8's error); accept_lossy=False recomputes them.
    config = tmp_path / "kvtier.toml"
    config.write_text('[store]\ndisk_codec = "int8"\n')
    daemon = KvtierDaemon(tmp_path, host_bytes="4MiB", extra_args=("--config", str(config)))
    daemon.start()
    try:
        ns = make_ns("mha", kv_dtype="bfloat16", layers=8, block_tokens=64)  # 32 KiB blocks
        writer = connect(cores, daemon, ns, "vllm-flash")
        exact = connect(cores, daemon, ns, "vllm-flash", accept_lossy=False)
        hashes = writer.block_hashes(tokens(200 * ns.block_tokens, seed=61))
        g = torch.Generator().manual_seed(62)
        blocks = [torch.randn(ns.num_layers, 2, ns.num_kv_heads, ns.block_tokens, ns.head_dim,
                              generator=g).to(torch.bfloat16) for _ in hashes]
        for lo in range(0, len(hashes), 20):  # saves of 20: the first blocks are demoted, re-encoded
            assert writer.store(hashes[lo:lo + 20], blocks[lo:lo + 20], layout="canonical",
                                parent=hashes[lo - 1] if lo else None) == 20
        assert writer.lookup(hashes) == 200
        assert exact.lookup(hashes) == 0, "block 0 is int8 on disk"
        assert exact.fetch(hashes[:1]) == []
        (lossy,) = writer.fetch(hashes[:1])
        assert not torch.equal(lossy, blocks[0])
        assert (lossy.float() - blocks[0].float()).abs().max() <= blocks[0].float().abs().max() / 100
        assert all(torch.equal(a, b) for a, b in zip(exact.fetch(hashes[-2:]), blocks[-2:])), "host copies: exact"
    finally:
        daemon.cleanup()


@pytest.mark.parametrize(("attention", "layout", "dtype", "codec"), [("mha", "vllm-flash", "bfloat16", "int8"),
                                                                    ("mha", "vllm-nhc", "float32", "int8"),
                                                                    ("mla", "mla-latent", "bfloat16", "int8"),
                                                                    ("mha", "vllm-flash", "float32", "int4")])
def test_quantizing_codecs_load_within_their_error_bound(kvtier_daemon_module: KvtierDaemon, cores: list,
                                                         attention: str, layout: str, dtype: str, codec: str) -> None:
    raw = make_ns(attention, kv_dtype=dtype, block_tokens=16)
    caches = make_caches(raw, layout, seed=8)
    writer = connect(cores, kvtier_daemon_module, raw, layout, codec=codec, caches=caches)
    assert writer.ns.kv_codec == codec and writer.ns.ns_id != raw.ns_id
    reader = connect(cores, kvtier_daemon_module, writer.ns, layout, caches=make_caches(raw, layout, seed=None))
    hashes = writer.block_hashes(tokens(2 * raw.block_tokens, seed=5))
    assert writer.save(hashes, [3, 6]) == 2
    assert connect(cores, kvtier_daemon_module, raw, layout).lookup(hashes) == 0, "raw readers never get lossy KV"
    assert reader.load(hashes, [0, 1]) == 2
    levels = (1 << int(codec[3:])) - 1
    for want, got in zip(blocks_of(writer, [3, 6]), blocks_of(reader, [0, 1])):
        w, g = want.float(), got.float()
        spread = (w.max() - w.min()).item()
        # at most half a step of a channel's (token's, group's) range / levels, then rounding to dtype
        assert (w - g).abs().max().item() <= spread / levels + w.abs().max().item() * 2 ** -7
        assert not torch.equal(w, g), "the codec is lossy: this block was quantized"
        if attention == "mla":  # the decoupled RoPE dims are kept raw
            assert torch.equal(bits(want[..., -raw.mla_rope_dim:]), bits(got[..., -raw.mla_rope_dim:]))


def test_misuse_raises_typed_errors(kvtier_daemon_module: KvtierDaemon, cores: list) -> None:
    ns = make_ns("mha")
    core = connect(cores, kvtier_daemon_module, ns)
    hashes = core.block_hashes(tokens(2 * ns.block_tokens))
    with pytest.raises(InvalidRequest, match="bind_kv_caches"):
        core.load(hashes, [0, 1])
    core.bind_kv_caches(make_caches(ns, "vllm-flash"))
    with pytest.raises(InvalidRequest, match="page ids"):
        core.save(hashes, [0])
    with pytest.raises(InvalidRequest, match="in \\[0, 8\\)"):
        core.load(hashes, [0, 8])
    with pytest.raises(LayoutError):
        core.bind_kv_caches(make_caches(ns, "vllm-nhc"))
    with pytest.raises(LayoutError):
        KVConnectorCore(make_ns("mla"), address=kvtier_daemon_module.address, page_layout="vllm-flash")
    assert core.lookup([]) == 0 and core.load([], []) == 0 and core.save([], []) == 0


def test_the_tcp_data_plane_moves_blocks_inline(tmp_path, cores: list) -> None:
    daemon = KvtierDaemon(tmp_path, host_bytes="32MiB", disk_bytes="0", extra_args=("--listen", "127.0.0.1:0"))
    try:
        daemon.start()
        ns = make_ns("mha", kv_dtype="bfloat16")
        writer = connect(cores, daemon.tcp_address(), ns, caches=make_caches(ns, "vllm-flash", seed=12),
                         token=daemon.token)
        reader = connect(cores, daemon.tcp_address(), ns, "vllm-nhc", caches=make_caches(ns, "vllm-nhc", seed=None),
                         token=daemon.token)
        hashes = writer.block_hashes(tokens(2 * ns.block_tokens, seed=10))
        assert writer.save(hashes, [3, 4]) == 2 and reader.lookup(hashes) == 2
        assert reader.load(hashes, [0, 1]) == 2
        assert reader.client.session is not None and reader.client.session.shm is None, "payloads inline"
        for a, b in zip(blocks_of(writer, [3, 4]), blocks_of(reader, [0, 1])):
            assert torch.equal(convert(a, "vllm-flash", "vllm-nhc"), b)
        bad = connect(cores, daemon.tcp_address(), ns, caches=make_caches(ns, "vllm-flash"), token="wrong")
        assert bad.lookup(hashes) == 0 and bad.save(hashes, [3, 4]) == 0, "a refused token degrades too"
    finally:
        daemon.cleanup()


# --- a daemon that is down, stopped or restarting -----------------------------------------------


def test_no_daemon_at_all_degrades_at_once(tmp_path, cores: list) -> None:
    ns = make_ns("mha")
    core = connect(cores, f"unix:{tmp_path}/none.sock", ns, caches=make_caches(ns, "vllm-flash"))
    hashes = core.block_hashes(tokens(2 * ns.block_tokens))
    # no socket: every call fails at once (refused, never waited out) and degrades
    for call in (lambda: core.lookup(hashes), lambda: core.load(hashes, [0, 1]), lambda: core.save(hashes, [0, 1])):
        assert call() == 0
    assert core.fetch(hashes) == [] and core.stats.failed_calls >= 4


def test_a_stopped_daemon_degrades_and_a_restarted_one_serves_again(kvtier_daemon: KvtierDaemon, cores: list,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    ns = make_ns("mha", kv_dtype="bfloat16")
    clock = ManualClock()
    core = connect(cores, kvtier_daemon, ns, caches=make_caches(ns, "vllm-flash", seed=9), clock=clock)
    reader = connect(cores, kvtier_daemon, ns, caches=make_caches(ns, "vllm-flash", seed=None), clock=clock)
    hashes = core.block_hashes(tokens(3 * ns.block_tokens, seed=6))
    assert core.save(hashes[:2], [0, 1]) == 2
    kvtier_daemon.stop()
    before = [b.clone() for b in blocks_of(reader, range(8))]
    for call in (lambda: reader.lookup(hashes), lambda: reader.load(hashes, [5, 6, 7]),
                 lambda: core.save(hashes, [0, 1, 2])):
        assert call() == 0  # refused at once, or within the hold-down: never waited out
    assert all(torch.equal(a, b) for a, b in zip(before, blocks_of(reader, range(8)))), "no page was touched"
    outage = [r for r in caplog.records if r.name == "kvtier.connector" and "unavailable" in r.getMessage()]
    assert len(outage) == 2, "each core logs an outage once, not once per call"
    kvtier_daemon.start()
    clock.advance(HOLDDOWN_S)  # the clients' hold-down after the outage is over
    assert reader.lookup(hashes) == 2, "the disk tier kept the blocks over the restart"
    assert reader.load(hashes, [5, 6, 7]) == 2
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(core, [0, 1]), blocks_of(reader, [5, 6])))
    assert core.save(hashes, [0, 1, 2]) == 1


def test_a_restart_between_calls_is_invisible(kvtier_daemon: KvtierDaemon, cores: list) -> None:
    ns = make_ns("mla")
    core = connect(cores, kvtier_daemon, ns, "mla-latent", caches=make_caches(ns, "mla-latent", seed=10))
    hashes = core.block_hashes(tokens(2 * ns.block_tokens, seed=7))
    assert core.save(hashes, [0, 1]) == 2
    kvtier_daemon.restart()
    # the connection broke while idle: the client reconnects (and remaps the new segments) on its own
    assert core.load(hashes, [2, 3]) == 2
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(core, [0, 1]), blocks_of(core, [2, 3])))


def test_a_paused_daemon_costs_one_timeout_then_fails_fast(kvtier_daemon: KvtierDaemon, cores: list) -> None:
    ns = make_ns("mha")
    clock = ManualClock()
    core = connect(cores, kvtier_daemon, ns, caches=make_caches(ns, "vllm-flash", seed=11), clock=clock)
    hashes = core.block_hashes(tokens(2 * ns.block_tokens, seed=8))
    assert core.save(hashes[:1], [0]) == 1
    kvtier_daemon.pause()
    try:
        with short_timeout(core.client):  # SIGSTOPped: only a timeout ends the call
            assert core.lookup(hashes) == 0
            for call in (lambda: core.load(hashes, [4, 5]), lambda: core.save(hashes, [0, 1])):
                assert call() == 0
            # within the hold-down a stuck daemon is not waited on again: the calls above failed
            # without asking it, as this one does
            with pytest.raises(Unavailable, match="moments ago"):
                core.client.lookup(ns.ns_id, hashes, degrade=False)
    finally:
        kvtier_daemon.resume()
    clock.advance(HOLDDOWN_S)
    assert core.lookup(hashes) == 1  # served again once the hold-down ends
    assert core.save(hashes, [0, 1]) == 1 and core.load(hashes, [4, 5]) == 2


def test_a_shared_client_is_used_and_not_closed(kvtier_daemon_module: KvtierDaemon) -> None:
    ns = make_ns("mha")
    with Client(kvtier_daemon_module.address, timeout_s=TIMEOUT_S) as client:
        with KVConnectorCore(ns, client=client) as core:
            core.bind_kv_caches(make_caches(ns, "vllm-flash"))
            hashes = core.block_hashes(tokens(ns.block_tokens, seed=9))
            assert core.save(hashes, [0]) == 1
        assert client.lookup(ns.ns_id, hashes).num_hits == 1


def test_a_block_of_the_wrong_geometry_or_dtype_stops_the_load(cores: list) -> None:
    # kvtierd refuses such records at save; a store that does not (here the client tests' toy peer)
    # must still never get them into the pages
    with tempfile.TemporaryDirectory(prefix="kvc-", dir="/tmp") as short_dir:
        peer = Peer(short_dir).start()
        try:
            ns = make_ns("mha")
            core = connect(cores, f"unix:{peer.unix_path}", ns, caches=make_caches(ns, "vllm-flash", seed=13))
            reader = connect(cores, f"unix:{peer.unix_path}", ns, caches=make_caches(ns, "vllm-flash", seed=None))
            hashes = core.block_hashes(tokens(4 * ns.block_tokens, seed=11))
            assert core.save(hashes[:1], [0]) == 1
            good = blocks_of(core, [1])[0]
            wrong = {1: good[:1], 2: good.to(torch.bfloat16)}  # one layer short; another dtype (both verify)
            for i, block in wrong.items():
                record = encode_block(block, ns_id=ns.ns_id, chain_hash=hashes[i], parent_hash=hashes[i - 1],
                                      layout="vllm-flash")
                assert core.client.save(ns.ns_id, [(hashes[i], record)]) == ["stored"]
            assert core.save(hashes, [0, 1, 2, 3]) == 1, "only the last block was missing"
            assert reader.lookup(hashes) == 4
            assert reader.load(hashes, [4, 5, 6, 7]) == 1
            assert not any(b.any() for b in blocks_of(reader, [5, 6, 7])), "nothing from the bad block on"
            assert reader.load(hashes[2:], [5, 6]) == 0, "a dtype the namespace does not have"
            assert len(reader.fetch(hashes)) == 1
            first = convert(blocks_of(core, [0])[0], "vllm-flash", "canonical")
            out = torch.empty((4, *first.shape), dtype=first.dtype)
            assert reader.fetch_into(hashes, out) == 1 and torch.equal(out[0], first)
        finally:
            peer.stop()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("attention", "layout", "codec"), [("mha", "vllm-flash", "raw"),
                                                            ("mla", "mla-latent", "int8")])
def test_cuda_pages_round_trip(kvtier_daemon_module: KvtierDaemon, cores: list, attention: str, layout: str,
                               codec: str) -> None:
    ns = make_ns(attention, kv_dtype="bfloat16", block_tokens=16)
    writer = connect(cores, kvtier_daemon_module, ns, layout, codec=codec,
                     caches=make_caches(ns, layout, seed=14, device="cuda"))
    reader = connect(cores, kvtier_daemon_module, writer.ns, layout,
                     caches=make_caches(ns, layout, seed=None, device="cuda"))
    assert reader._views is None, "GPU pages take the batched decode-and-transfer path"
    hashes = writer.block_hashes(tokens(3 * ns.block_tokens, seed=12))
    assert writer.save(hashes, [0, 2, 4]) == 3 and reader.load(hashes, [5, 3, 1]) == 3
    for want, got in zip(blocks_of(writer, [0, 2, 4]), blocks_of(reader, [5, 3, 1])):
        assert got.device.type == "cuda"
        if codec == "raw":
            assert torch.equal(bits(want), bits(got))
        else:
            w, g = want.float(), got.float()
            assert (w - g).abs().max().item() <= (w.max() - w.min()).item() / 255 + w.abs().max().item() * 2 ** -7
