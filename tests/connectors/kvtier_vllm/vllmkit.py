"""A miniature of vLLM 0.33's engine loop for driving KVTierConnector without vLLM.

It makes the objects vLLM hands a connector (configs, KVCacheConfig, requests with their own
block hashes, SchedulerOutput, KVConnectorOutput) with the fields the connector reads, lays out
KV caches as vLLM does (0.33: one backing buffer per layer set, strided ``[B, H, N, C]`` views
over an LBNHC or LBHNC physical order; legacy: ``(2, B, N, H, D)`` per layer), and runs one
engine step in the exact order of engine-interfaces.md §1.4.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any

import torch

from kvtier_protocol.keys import ExtraKeys, chain_hashes

from kvtier_vllm import KVTierConnector
from kvtier_vllm.compat import KVConnectorRole

from tests.kvtier.conftest import KvtierDaemon  # the real ``kvtier serve`` subprocess
from tests.kvtier.waitkit import PATIENCE_S

__all__ = ["KvtierDaemon"]

BLOCK = 4
LAYERS = 2
HEADS = 2
HEAD = 8
MLA_C = 12
NUM_BLOCKS = 32
LAYOUTS = ("v033-lbnhc", "v033-lbhnc", "legacy-flash", "v033-mla")


def vllm_config(address: str, *, tp_size: int = 1, rank: int = 0, model: str | None = None, **extra: Any) -> Any:
    """A vLLM config with the fields KVTierConnector reads."""
    # calls that must succeed: a timeout no busy machine comes near
    extra = {"address": address, "timeout_s": 60.0, **extra}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector="KVTierConnector", kv_connector_module_path="kvtier_vllm",
                                           kv_role="kv_both", kv_connector_extra_config=extra, is_kv_producer=True),
        cache_config=SimpleNamespace(block_size=BLOCK, prefix_caching_hash_algo="sha256_cbor"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, pipeline_parallel_size=1, rank=rank),
        model_config=SimpleNamespace(model=model or f"test-{secrets.token_hex(6)}", served_model_name=None,
                                     revision="r1", hf_config=SimpleNamespace(qk_rope_head_dim=4)))


def kv_cache_config(layout: str) -> Any:
    """A single-group KVCacheConfig (MLA for ``v033-mla``)."""
    mla = layout == "v033-mla"
    spec = SimpleNamespace(block_size=BLOCK, num_kv_heads=1 if mla else HEADS, head_size=MLA_C if mla else HEAD,
                           head_size_v=0 if mla else HEAD, dtype=torch.float32)
    group = SimpleNamespace(layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                            kv_cache_spec=spec)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[group], hash_block_size=BLOCK)


def make_caches(layout: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Per-layer KV caches as vLLM registers them, zero-filled."""
    names = kv_cache_config(layout).kv_cache_groups[0].layer_names
    b, n = NUM_BLOCKS, BLOCK
    if layout == "legacy-flash":
        return {name: torch.zeros(2, b, n, HEADS, HEAD, device=device) for name in names}
    h, c = (1, MLA_C) if layout == "v033-mla" else (HEADS, 2 * HEAD)
    backing = torch.zeros(LAYERS * b * h * n * c * 4, dtype=torch.int8, device=device).view(torch.float32)
    if layout == "v033-lbhnc":
        phys = backing.view(LAYERS, b, h, n, c)
        return {name: phys[i] for i, name in enumerate(names)}
    phys = backing.view(LAYERS, b, n, h, c)  # LBNHC: the [B, H, N, C] view is strided
    return {name: phys[i].transpose(1, 2) for i, name in enumerate(names)}


def page(cache: torch.Tensor, layout: str, block_id: int) -> torch.Tensor:
    """One block of one layer, copied out."""
    return (cache[:, block_id] if layout == "legacy-flash" else cache[block_id]).clone()


def token_kv(tokens: list[int], pos: int, layer: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The "forward": KV of position ``pos`` depends on the whole prefix up to it, as real KV does."""
    digest = hashlib.sha256(repr((layer, tokens[:pos + 1])).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(shape, generator=g)


def write_token(cache: torch.Tensor, layout: str, block_id: int, slot: int, kv: torch.Tensor) -> None:
    if layout == "legacy-flash":
        cache[0, block_id, slot] = kv[:, :HEAD]
        cache[1, block_id, slot] = kv[:, HEAD:]
    else:
        cache[block_id, :, slot] = kv


@dataclass
class Request:
    """The fields of vLLM's ``Request`` the connector reads; block hashes as vLLM's sha256_cbor makes them."""

    request_id: str
    prompt_token_ids: list[int]
    extras: ExtraKeys = field(default_factory=ExtraKeys)
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: str = "WAITING"

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._rehash()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append(self, token: int) -> None:
        self.all_token_ids.append(token)
        self._rehash()

    def _rehash(self) -> None:
        self.block_hashes = chain_hashes(self.all_token_ids, BLOCK, extras=self.extras)


class Blocks:
    """vLLM's ``KVCacheBlocks`` as the connector sees it."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


class MiniEngine:
    """One scheduler connector and one worker connector stepped in vLLM's order (§1.4)."""

    def __init__(self, address: str, layout: str, **extra: Any) -> None:
        self.layout = layout
        model = extra.pop("model", None)
        self.config = vllm_config(address, model=model, **extra)
        kvc = kv_cache_config(layout)
        self.sched = KVTierConnector(self.config, KVConnectorRole.SCHEDULER, kvc)
        self.worker = KVTierConnector(self.config, KVConnectorRole.WORKER, kvc)
        self.caches = make_caches(layout)
        self.worker.register_kv_caches(self.caches)
        self.free = list(range(1, NUM_BLOCKS))  # block 0 is vLLM's null block
        self.waiting: list[Request] = []
        self.remote: list[Request] = []  # WAITING_FOR_REMOTE_KVS
        self.running: list[Request] = []
        self.ready: list[Request] = []  # loaded asynchronously, scheduled next step
        self.before_worker: Callable[[], None] | None = None
        self.held: dict[str, Request] = {}  # finished, blocks kept for saves
        self.finished_ids: set[str] = set()
        self.matched: dict[str, int] = {}
        self.invalid: set[int] = set()
        self.events: list[Any] = []
        self.outputs: list[Any] = []
        self.layer_log: list[tuple[str, int]] = []

    def add(self, request: Request) -> Request:
        self.waiting.append(request)
        return request

    def layer_pages(self, block_id: int) -> list[torch.Tensor]:
        return [page(c, self.layout, block_id) for c in self.caches.values()]

    def step(self) -> Any:
        """One engine step; returns the KVConnectorOutput the worker produced."""
        new, cached, scheduled, has_sync = list(self.ready), [], {}, False
        self.ready = []
        for req in self.waiting:  # 1. scheduler: lookup, allocate, update_state_after_alloc
            ext, is_async = self.sched.get_num_new_matched_tokens(req, 0)
            assert ext is not None and ext % BLOCK == 0 and ext < req.num_tokens
            assert not (ext == 0 and is_async)
            self.matched[req.request_id] = ext
            req.block_ids = [self.free.pop(0) for _ in range(-(-req.num_tokens // BLOCK))]
            self.sched.update_state_after_alloc(req, Blocks(req.block_ids), ext)
            if is_async:
                req.status = "WAITING_FOR_REMOTE_KVS"
                self.remote.append(req)
            else:
                req.num_computed_tokens = ext
                has_sync |= ext > 0
                new.append(req)
        self.waiting = []
        for req in new:
            req.status = "RUNNING"
            scheduled[req.request_id] = req.num_tokens - req.num_computed_tokens
        for req in self.running:
            if req.num_computed_tokens < req.num_tokens:
                scheduled[req.request_id] = req.num_tokens - req.num_computed_tokens
                cached.append(req)
        self.running.extend(new)
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(list(r.block_ids),),
                                                num_computed_tokens=r.num_computed_tokens) for r in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r in cached], resumed_req_ids=set(),
                                                  new_block_ids=[None] * len(cached),
                                                  num_computed_tokens=[r.num_computed_tokens for r in cached]),
            num_scheduled_tokens=scheduled, finished_req_ids=self.finished_ids, has_sync_kv_loads=has_sync)
        self.finished_ids = set()
        meta = self.sched.build_connector_meta(out)
        if self.before_worker is not None:  # a test's fault, between the scheduler's plan and the worker
            self.before_worker, hook = None, self.before_worker
            hook()
        # 2. worker
        self.worker.bind_connector_metadata(meta)
        if has_sync:
            self.worker.start_load_kv(SimpleNamespace())
        self._forward(new + cached, scheduled)
        if not has_sync:
            self.worker.start_load_kv(SimpleNamespace())
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        output = SimpleNamespace(finished_sending=sending, finished_recving=recving,
                                 invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
                                 kv_connector_worker_meta=self.worker.build_connector_worker_meta())
        self.worker.clear_connector_metadata()
        for req in new + cached:
            req.num_computed_tokens += scheduled[req.request_id]
        # 3. scheduler: update_from_output
        self.sched.update_connector_output(output)
        self.invalid |= output.invalid_block_ids
        for req_id in recving or ():
            req = next(r for r in self.remote if r.request_id == req_id)
            self.remote.remove(req)
            req.num_computed_tokens = self.matched[req_id]
            self.ready.append(req)  # scheduled as a new request next step, its loaded tokens computed
        for req in self.running + self.ready:  # kv_load_failure_policy="recompute"
            bad = [j for j, block in enumerate(req.block_ids) if block in output.invalid_block_ids]
            if bad:
                req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * BLOCK)
        for req_id in sending or ():
            self._free(self.held.pop(req_id))
        self.events.extend(self.sched.take_events())
        self.outputs.append(output)
        return output

    def run_until_idle(self, max_steps: int = 500, timeout_s: float = PATIENCE_S) -> None:
        """Step until nothing waits, loads or is scheduled: at most ``max_steps`` steps with work,
        and as many idle steps as the background loads take (within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        while True:
            busy = self.waiting or self.ready or any(r.num_computed_tokens < r.num_tokens for r in self.running)
            if not busy and not self.remote:
                return
            if busy:
                steps += 1
                assert steps <= max_steps, "the engine did not go idle"
            else:
                assert time.monotonic() < deadline, f"background loads still running after {timeout_s} s"
                time.sleep(0.005)  # only background loads left: vLLM keeps stepping meanwhile
            self.step()

    def _forward(self, reqs: list[Request], scheduled: dict[str, int]) -> None:
        """One forward over every scheduled request, layer by layer as vLLM runs it: each attention
        layer waits for its loads, writes every request's new tokens, then hands the layer to saves.
        ``layer_log`` records ``("enter", i)`` / ``("exit", i)`` around each layer."""
        for layer, (name, cache) in enumerate(self.caches.items()):
            self.worker.wait_for_layer_load(name)
            self.layer_log.append(("enter", layer))
            for req in reqs:
                for pos in range(req.num_computed_tokens, req.num_computed_tokens + scheduled[req.request_id]):
                    shape = (1, MLA_C) if self.layout == "v033-mla" else (HEADS, 2 * HEAD)
                    kv = token_kv(req.all_token_ids, pos, layer, shape)
                    write_token(cache, self.layout, req.block_ids[pos // BLOCK], pos % BLOCK, kv)
            self.worker.save_kv_layer(name, cache, None)
            self.layer_log.append(("exit", layer))

    def finish(self, req: Request) -> bool:
        """The request ends; returns request_finished's "keep the blocks" answer."""
        self.running.remove(req)
        keep, params = self.sched.request_finished_all_groups(req, (list(req.block_ids),))
        assert params is None
        self.finished_ids.add(req.request_id)
        if keep:
            self.held[req.request_id] = req
        else:
            self._free(req)
        return keep

    def _free(self, req: Request) -> None:
        self.free.extend(req.block_ids)
        req.block_ids = []

    def settle(self) -> None:
        """Let queued saves end, then step twice: reports reach the scheduler, held requests are released."""
        self.worker.worker.wait_idle(PATIENCE_S)
        self.step()
        self.step()

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()
