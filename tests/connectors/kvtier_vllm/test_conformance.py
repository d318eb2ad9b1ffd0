"""KVTierConnector against vLLM 0.33's own interfaces: factory, ABCs and signatures, hashing, events.

Runs where vLLM imports (the engine-interface environment: see docs/engines.md, "Conformance with the
engines' own interfaces");
skipped elsewhere.
"""

from __future__ import annotations

import inspect
import secrets
import time
import warnings

import pytest

with warnings.catch_warnings():  # vLLM's import chain warns about torch APIs (filterwarnings=error)
    warnings.simplefilter("ignore", DeprecationWarning)
    vllm = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                               reason="vLLM 0.33 interfaces not importable (build them with "
                                      "tools/conformance.sh)")
    import msgspec  # vLLM's own dependency
    import zmq
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorWorkerMetadata, SupportsHMA)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from kvtier_protocol.keys import ExtraKeys, chain_hashes

from kvtier.client import Client

import kvtier_vllm
from kvtier_vllm.metadata import KVTierMetadata, KVTierWorkerMeta
from tests.connectors.kvtier_vllm.vllmkit import (BLOCK, KvtierDaemon, MiniEngine, Request,
                                                   vllm_config)
from tests.kvtier.client.clientkit import NS_ID, make_blocks
from tests.kvtier.waitkit import PATIENCE_S, wait_until


def transfer_config():
    from vllm.config.kv_transfer import KVTransferConfig
    return KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier_vllm",
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"address": "unix:/nonexistent/kvtier.sock"})


def test_factory_resolves_our_class_from_module_path():
    cls = KVConnectorFactory.get_connector_class(transfer_config())
    assert cls is kvtier_vllm.KVTierConnector
    assert issubclass(cls, KVConnectorBase_V1) and issubclass(cls, SupportsHMA)
    assert KVConnectorFactory.supports_hma_config(transfer_config())
    assert issubclass(KVTierMetadata, KVConnectorMetadata)
    assert issubclass(KVTierWorkerMeta, KVConnectorWorkerMetadata)


def test_every_abstract_method_is_implemented_with_a_compatible_signature():
    cls = kvtier_vllm.KVTierConnector
    assert not inspect.isabstract(cls), getattr(cls, "__abstractmethods__", None)
    names = {n for n, v in vars(KVConnectorBase_V1).items() if callable(v) and not n.startswith("__")}
    names |= {"request_finished_all_groups"}
    checked = 0
    for name in sorted(names):
        ours = inspect.getattr_static(cls, name)
        if ours is inspect.getattr_static(KVConnectorBase_V1, name, None):
            continue  # inherited unchanged
        base = getattr(KVConnectorBase_V1, name, None) or getattr(SupportsHMA, name)
        want = list(inspect.signature(base).parameters.values())
        got = list(inspect.signature(getattr(cls, name)).parameters.values())
        assert [p.name for p in got] == [p.name for p in want], name
        assert [p.kind for p in got] == [p.kind for p in want], name
        checked += 1
    assert checked >= 15
    ours = list(inspect.signature(cls.__init__).parameters)
    assert ours == ["self", "vllm_config", "role", "kv_cache_config"]


@pytest.mark.parametrize("extra", [None, ("lora", "adapter", "/path"), ("cache_salt", "tenant-a")])
def test_vllm_hashing_gives_the_hashes_the_connector_assumes(extra):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    kv_cache_utils.init_none_hash(hash_fn)
    tokens = list(range(1000, 1000 + 5 * BLOCK + 3))
    parent, theirs = None, []
    for i in range(5):
        block_extra = (extra,) if extra is not None and (extra[0] != "cache_salt" or i == 0) else None
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent or kv_cache_utils.NONE_HASH,
                                                  tokens[i * BLOCK:(i + 1) * BLOCK], block_extra)
        theirs.append(bytes(parent))
    extras = ExtraKeys()
    if extra is not None and extra[0] == "lora":
        extras = ExtraKeys(lora_name=extra[1], lora_path=extra[2])
    elif extra is not None:
        extras = ExtraKeys(cache_salt=extra[1])
    assert chain_hashes(tokens, BLOCK, extras=extras) == theirs
    assert Request("r", tokens, extras=extras).block_hashes == theirs  # the harness's requests hash as vLLM
    # the engine-interfaces.md §3 vector: tokens 0..15, no extras
    first = kv_cache_utils.hash_block_tokens(hash_fn, kv_cache_utils.NONE_HASH, list(range(16)), None)
    assert bytes(first).hex().startswith("dc918a88") and int.from_bytes(first[-8:], "big") == 2233398808101521225
    assert chain_hashes(list(range(16)), 16) == [bytes(first)]


def test_real_vllm_request_feeds_the_scheduler_side(tmp_path):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request as VllmRequest
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK, hash_fn)
    daemon = KvtierDaemon(tmp_path).start()
    try:
        eng = MiniEngine(daemon.address, "v033-lbnhc")
        prompt = list(range(500, 500 + 3 * BLOCK + 1))
        req = eng.add(Request("ours", prompt))
        eng.run_until_idle()
        eng.finish(req)
        eng.settle()
        theirs = VllmRequest("theirs", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        assert list(theirs.block_hashes) == req.block_hashes[:3]
        assert eng.sched.get_num_new_matched_tokens(theirs, 0) == (3 * BLOCK, True)
        eng.close()
    finally:
        daemon.cleanup()


def test_daemon_events_decode_with_vllm_event_classes(tmp_path):
    port = 20000 + secrets.randbelow(20000)
    daemon = KvtierDaemon(tmp_path)
    daemon._args += ["--events", f"tcp://127.0.0.1:{port}", "--topic", "kv@pod@model"]
    daemon.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        # A PUB socket drops what it sends before a subscription reached it: store probe blocks
        # until one of their events arrives, then the subscription is live (their hashes are
        # left out below).
        probes: set[int] = set()

        def subscribed() -> bool:
            blocks = make_blocks(1, 4096, tag=b"probe%d" % len(probes))
            probes.add(int.from_bytes(blocks[0][0][-8:], "big"))
            assert probe.save(NS_ID, blocks) == ["stored"]
            return sub.poll(200) != 0

        with Client(daemon.address, timeout_s=PATIENCE_S) as probe:
            wait_until(subscribed, interval_s=0, what="the subscription reaching the publisher")
        eng = MiniEngine(daemon.address, "v033-lbnhc")
        req = eng.add(Request("e", list(range(7, 7 + 2 * BLOCK + 1))))
        eng.run_until_idle()
        eng.finish(req)
        eng.settle()
        eng.close()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        stored = []
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline and len(stored) < 2:
            if not sub.poll(200):
                continue
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@pod@model" and len(seq) == 8
            batch = decoder.decode(payload)
            for event in batch.events:
                assert isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared))
                if isinstance(event, BlockStored):
                    stored.extend(h for h in event.block_hashes if h not in probes)
        assert stored[:2] == [int.from_bytes(h[-8:], "big") for h in req.block_hashes[:2]]
    finally:
        sub.close(0)
        ctx.term()
        daemon.cleanup()


def test_vllm_config_objects_build_the_connector():
    """vLLM's own KVTransferConfig parses our documented --kv-transfer-config."""
    cfg = transfer_config()
    assert cfg.kv_connector_module_path == "kvtier_vllm" and cfg.is_kv_producer and cfg.is_kv_consumer
    assert kvtier_vllm.KVTierConfig.from_extra(cfg.kv_connector_extra_config).address.startswith("unix:")
    assert vllm_config("unix:/x").kv_transfer_config.kv_connector == cfg.kv_connector
