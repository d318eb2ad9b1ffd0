"""The worker's half of the connector (runs in each vLLM GPU worker): moves blocks between the
engine's paged KV caches and the daemon through :class:`kvtier.connector.KVConnectorCore`.

Per step, in vLLM's order: ``start_load_kv`` runs the step's loads (synchronous ones at once,
asynchronous ones on the core's job thread); after the forward, ``wait_for_save`` snapshots the
pages of the step's saves (a device copy, so vLLM may reuse the blocks) and hands them to the
job thread; ``get_finished`` reports finished asynchronous loads and the held requests whose
saves ended; ``get_block_ids_with_load_errors`` names the blocks a load did not fill (vLLM
recomputes them under ``kv_load_failure_policy="recompute"``).

Layer by layer (``layerwise``, the default): a synchronous load's records are fetched and
verified on the core's load thread and placed one layer at a time on the load stream;
``wait_for_layer_load`` (on entry to each attention layer) waits for that layer only, so loading
layer ``i + 1`` overlaps computing layer ``i``. ``save_kv_layer`` (on exit from each attention
layer) copies that layer of the step's save blocks to host staging once the compute that wrote
them is done (an event on the compute stream); ``wait_for_save`` then stores them in the
background and orders the engine's later compute after those copies, so vLLM may reuse the
blocks. A step whose saves were not fed every layer (no per-layer hooks, e.g. a whole CUDA
graph) saves whole blocks as without ``layerwise``: a device snapshot in ``wait_for_save``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from kvtier.connector import JobResult, KVConnectorCore
from kvtier.connector.layerwise import LayerLoad, LayerSave

from kvtier_vllm.caches import paged_caches
from kvtier_vllm.compat import tensor_parallel_rank
from kvtier_vllm.config import KVTierConfig, geometry_of, namespace_for
from kvtier_vllm.metadata import KVTierMetadata, KVTierWorkerMeta, LoadSpec, SaveSpec

log = logging.getLogger("kvtier.vllm")


class WorkerSide:
    """Loads and saves of one vLLM worker (one TP rank).

    Args:
        vllm_config: vLLM's config (parallel sizes, this worker's rank).
        kv_cache_config: this worker's ``KVCacheConfig``.
        config: the connector's settings.
        tp_rank: this worker's TP rank; None: vLLM's process group (or the config's rank).
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: KVTierConfig, *,
                 tp_rank: int | None = None) -> None:
        self.config = config
        self.geometry = geometry_of(kv_cache_config)
        self.tp_rank = tensor_parallel_rank(vllm_config) if tp_rank is None else tp_rank
        self.ns = namespace_for(vllm_config, self.geometry, config, tp_rank=self.tp_rank)
        # MLA KV is the same on every rank: rank 0 writes it, every rank reads it.
        self.writes = not self.geometry.mla or self.tp_rank == 0
        self.core: KVConnectorCore | None = None
        self._jobs: dict[int, LoadSpec | SaveSpec] = {}
        self._loading: dict[str, int] = {}  # req id -> unfinished load jobs
        self._saving: dict[str, int] = {}  # req id -> unfinished save jobs
        self._finished_recving: set[str] = set()
        self._held: set[str] = set()  # finished requests whose blocks vLLM keeps for our saves
        self._finished: set[str] = set()  # finished requests (vLLM's finished_req_ids) we saved for
        self._saved_for: set[str] = set()  # requests with a save on this worker, until released
        self._load_errors: set[int] = set()
        self._report = KVTierWorkerMeta()
        self._layer_of: dict[str, int] = {name: i for i, name in enumerate(self.geometry.layer_names)}
        self._step_loads: list[tuple[LoadSpec, LayerLoad]] = []  # this step's layer-wise sync loads
        self._step_saves: list[tuple[SaveSpec, LayerSave]] | None = None  # None until the first save_kv_layer

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> str:
        """Bind vLLM's per-layer caches (views, never copies); returns the core page layout used.

        Raises:
            LayoutError: caches in no layout kvtier_vllm reads, or not of the namespace's geometry.
        """
        paged = paged_caches(kv_caches, self.geometry)
        if self.core is None:
            self.core = KVConnectorCore(self.ns, address=self.config.daemon_address(), page_layout=paged.page_layout,
                                        timeout_s=self.config.timeout_s, token=self.config.daemon_token(),
                                        accept_lossy=self.config.accept_lossy)
        self.core.bind_kv_caches(paged.caches)
        log.info("kvtier: %d layers of %s pages bound (namespace %s, rank %d)", len(paged.caches),
                 paged.page_layout, self.ns.ns_id.hex(), self.tp_rank)
        return paged.page_layout

    def _bound(self) -> KVConnectorCore:
        assert self.core is not None, "register_kv_caches() first"
        return self.core

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Start the step's loads: synchronous ones complete here, asynchronous ones on the job thread."""
        core = self._bound()
        core.release_pages()  # loads and this step's compute come after earlier saves' reads
        for spec in meta.loads:
            if spec.is_async:
                self._jobs[core.submit_load(spec.hashes, spec.block_ids)] = spec
                self._loading[spec.req_id] = self._loading.get(spec.req_id, 0) + 1
            elif self.config.layerwise:
                self._step_loads.append((spec, core.start_load(spec.hashes, spec.block_ids)))
            else:
                self._load_errors.update(spec.block_ids[core.load(spec.hashes, spec.block_ids):])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this layer's pages of the step's synchronous loads are in place (queued
        before the compute stream's next work)."""
        if not self._step_loads:
            return
        layer, core = self._layer_of[layer_name], self._bound()
        for _, load in self._step_loads:
            load.wait_layer(layer, core.streams.compute)

    def save_kv_layer(self, meta: KVTierMetadata, layer_name: str) -> None:
        """This layer of the step's save blocks is written (by the compute queued so far): copy it out."""
        if not self.config.layerwise or not self.writes or not meta.saves:
            return
        if self._step_saves is None:  # the step's first layer: start its saves
            core = self._bound()
            self._step_saves = [(spec, core.start_save(spec.hashes, spec.block_ids, token_ids=spec.token_ids,
                                                       parent=spec.parent, priority=self.config.priority))
                                for spec in meta.saves]
        layer = self._layer_of[layer_name]
        for _, save in self._step_saves:
            save.layer_done(layer)

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        """Collect the step's layer-wise loads; queue the step's saves (fed layer by layer, else a
        snapshot of their pages now); learn which finished requests are held."""
        self._held.update(meta.held)
        for spec, load in self._step_loads:
            result = load.result()
            if result.num_blocks < len(spec.block_ids):
                log.warning("kvtier: load for %s filled %d of %d blocks (%s); vLLM recomputes the rest",
                            spec.req_id, result.num_blocks, len(spec.block_ids), result.error)
                self._load_errors.update(spec.block_ids[result.num_blocks:])
        self._step_loads = []
        fed = {id(spec): save for spec, save in self._step_saves or ()}
        self._step_saves = None
        for spec in meta.saves:
            self._saved_for.add(spec.req_id)
            if not self.writes:
                self._report_save(spec, stored=True)
                continue
            save = fed.get(id(spec))
            if save is not None and save.job is not None:
                job = save.job
            else:
                if save is not None:  # not every layer was fed: save whole blocks instead
                    save.abandon()
                job = self._bound().submit_save(spec.hashes, spec.block_ids, token_ids=spec.token_ids,
                                                parent=spec.parent, priority=self.config.priority)
            self._jobs[job] = spec
            self._saving[spec.req_id] = self._saving.get(spec.req_id, 0) + 1
        if self.core is not None:
            self.core.release_pages()  # vLLM's next writes to these blocks come after the copies

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(held requests whose saves all ended here, requests whose asynchronous loads ended)``."""
        self._finished.update(r for r in finished_req_ids if r in self._saved_for)
        if self.core is not None:
            for result in self.core.poll():
                self._job_ended(result)
        sending = {r for r in self._held & self._finished if not self._saving.get(r)}
        for req_id in sending:
            self._held.discard(req_id)
            self._finished.discard(req_id)
            self._saved_for.discard(req_id)
        recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def _job_ended(self, result: JobResult) -> None:
        spec = self._jobs.pop(result.job, None)
        if spec is None:
            return
        if isinstance(spec, LoadSpec):
            if result.num_blocks < len(spec.block_ids):
                log.warning("kvtier: load for %s filled %d of %d blocks (%s); vLLM recomputes the rest",
                            spec.req_id, result.num_blocks, len(spec.block_ids), result.error)
                self._load_errors.update(spec.block_ids[result.num_blocks:])
            self._loading[spec.req_id] -= 1
            if not self._loading[spec.req_id]:
                del self._loading[spec.req_id]
                self._finished_recving.add(spec.req_id)
            return
        self._saving[spec.req_id] -= 1
        if not self._saving[spec.req_id]:
            del self._saving[spec.req_id]
        self._report_save(spec, stored=result.ok)

    def _report_save(self, spec: SaveSpec, *, stored: bool) -> None:
        self._report.done.setdefault(spec.req_id, []).append(spec.seq)
        if stored:
            self._report.stored.setdefault(spec.req_id, []).append(spec.seq)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KVTierWorkerMeta | None:
        """Saves that ended since the last call, or None."""
        if not self._report.done:
            return None
        report, self._report = self._report, KVTierWorkerMeta()
        return report

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until every queued load and save has ended (their results are reported as usual)."""
        if self.core is None:
            return
        for job in list(self._jobs):
            if job in self._jobs:
                self._job_ended(self.core.wait(job, timeout_s))

    def shutdown(self) -> None:
        """Finish the running job, drop queued ones, close the daemon connections."""
        if self.core is not None:
            self.core.close()
