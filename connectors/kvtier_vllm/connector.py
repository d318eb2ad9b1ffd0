"""``KVTierConnector``: vLLM's ``KVConnectorBase_V1`` + ``SupportsHMA`` over the kvtier daemon.

vLLM builds one instance per role: the scheduler's (a :class:`SchedulerSide`) and each worker's
(a :class:`WorkerSide`). Every vLLM hook is one delegating line; the roles' logic lives in their
modules. Load it with::

    --kv-transfer-config '{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier_vllm",
                           "kv_role":"kv_both","kv_load_failure_policy":"recompute",
                           "kv_connector_extra_config":{"address":"unix:/run/kvtier/kvtier.sock"}}'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kvtier_vllm.compat import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from kvtier_vllm.config import KVTierConfig, check_hash_algo
from kvtier_vllm.metadata import KVTierMetadata, KVTierWorkerMeta
from kvtier_vllm.scheduler import SchedulerSide
from kvtier_vllm.worker import WorkerSide


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's V1 KV connector for kvtier: prefix blocks saved to and loaded from the daemon.

    Args:
        vllm_config: vLLM's config; ``kv_transfer_config.kv_connector_extra_config`` holds the
            :class:`KVTierConfig` keys.
        role: ``KVConnectorRole.SCHEDULER`` or ``KVConnectorRole.WORKER``.
        kv_cache_config: the engine's (scheduler) or this worker's KV-cache config.

    Raises:
        InvalidRequest: bad settings or an unusable hash algorithm.
        LayoutError: a KV cache kvtier does not store (hybrid groups, an unsupported dtype).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = KVTierConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        check_hash_algo(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, config)
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, *args: Any, **kwargs: Any) -> bool:
        """Layer-wise transfers run in the per-layer hooks, which a whole CUDA graph would skip."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a dropped save is only a later miss."""
        return False

    # -- worker side ----------------------------------------------------------------------------

    @property
    def worker(self) -> WorkerSide:
        """The worker half (WORKER role only)."""
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    @property
    def scheduler(self) -> SchedulerSide:
        """The scheduler half (SCHEDULER role only)."""
        assert self._scheduler is not None, "a scheduler-side call on a worker's connector"
        return self._scheduler

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata), f"unexpected connector metadata {type(meta).__name__}"
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        return self.worker.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # kvtier stores one KV-cache group (geometry_of refuses hybrid models), so group 0 is all of it.
        return self.scheduler.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> Iterable[Any]:
        return self.scheduler.take_events()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_saves()
