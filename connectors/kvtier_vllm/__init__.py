"""kvtier's vLLM connector: ``KVTierConnector``, a ``KVConnectorBase_V1`` + ``SupportsHMA`` connector.

Load it by configuration alone::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KVTierConnector",
        "kv_connector_module_path":"kvtier_vllm","kv_role":"kv_both",
        "kv_load_failure_policy":"recompute","kv_connector_extra_config":{...}}'

vLLM is imported only when :class:`KVTierConnector` is first used (this module's ``__getattr__``),
and then only if it is installed: without vLLM the connector runs on stand-in base classes
(:mod:`kvtier_vllm.compat`), which is how the harness tests drive it.
"""

from __future__ import annotations

from typing import Any

from kvtier_vllm.config import KVTierConfig

__all__ = ["KVTierConfig", "KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier_vllm.connector import KVTierConnector
        return KVTierConnector
    raise AttributeError(f"module 'kvtier_vllm' has no attribute {name!r}")
