"""vLLM's connector base classes when vLLM imports, stand-ins with the same contract when it does not.

vLLM is imported here and nowhere else at module level, and only inside ``try``: the package must
import (and its harness tests run) on machines without vLLM, where the connector is driven
through the same calls vLLM makes. With vLLM present, :class:`KVTierConnector` subclasses vLLM's
own ``KVConnectorBase_V1`` and ``SupportsHMA``, so vLLM's factory and ``isinstance`` checks see a
real connector.
"""

from __future__ import annotations

import enum
import logging
import warnings
from abc import ABC, abstractmethod
from typing import Any

log = logging.getLogger("kvtier.vllm")

def _import_vllm() -> bool:
    # vLLM's import chain warns about torch APIs it uses; those are not the caller's to fail on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
        except ImportError:
            return False
    return True


HAVE_VLLM = _import_vllm()
if HAVE_VLLM:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
else:

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """vLLM's roles: the scheduler's instance (EngineCore) and each GPU worker's."""

        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # type: ignore[no-redef]  # noqa: B024
        """Scheduler -> worker metadata of one step (vLLM's empty ABC)."""

    class KVConnectorWorkerMetadata(ABC):  # type: ignore[no-redef]
        """Worker -> scheduler metadata of one step, merged over workers by :meth:`aggregate`."""

        @abstractmethod
        def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
            """Merge another worker's metadata of the same step into this one."""

    class SupportsHMA(ABC):  # type: ignore[no-redef]
        """Marks a connector that handles several KV-cache groups (vLLM's hybrid allocator)."""

        @abstractmethod
        def request_finished_all_groups(self, request: Any,
                                        block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
            """:meth:`request_finished` with one block id list per KV-cache group."""

    class KVConnectorBase_V1(ABC):  # type: ignore[no-redef]  # noqa: N801
        """What vLLM's base class keeps for its subclasses: the configs, the role, the bound metadata."""

        def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
            if vllm_config.kv_transfer_config is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._connector_metadata: KVConnectorMetadata | None = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._kv_cache_manager: Any = None
            self._role = role

        @property
        def role(self) -> KVConnectorRole:
            return self._role

        def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def _get_connector_metadata(self) -> KVConnectorMetadata:
            assert self._connector_metadata is not None, "bind_connector_metadata() first"
            return self._connector_metadata


def tensor_parallel_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank: vLLM's process group when it is up, else the config's rank."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if HAVE_VLLM:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            return int(get_tensor_model_parallel_rank())
        except (AssertionError, RuntimeError, ImportError):
            pass  # no initialized group (tests, or a process outside vLLM's workers)
    return int(getattr(vllm_config.parallel_config, "rank", 0)) % tp_size


def block_stored_event(**fields: Any) -> Any:
    """A vLLM ``BlockStored`` event with ``fields``, or the same fields as a dict without vLLM."""
    if HAVE_VLLM:
        from vllm.distributed.kv_events import BlockStored
        return BlockStored(**fields)
    return {"type": "BlockStored", **fields}
