"""The engine-agnostic connector core and its parts (docs/design.md §4).

:class:`KVConnectorCore` moves prefix blocks between an engine's paged KV caches and the kvtier
daemon, whole or layer by layer (:class:`LayerLoad`, :class:`LayerSave`, on the :class:`Streams`
of :mod:`kvtier.connector.streams`); :func:`namespace_for_checkpoint` names the KV of a checkpoint (geometry from its
config.json, revision from a digest of its weights). Engine adapters (the reference engine,
vLLM, SGLang, HF transformers) are thin layers over these.
"""

from kvtier_protocol.address import default_address
from kvtier.connector.core import KVConnectorCore
from kvtier.connector.jobs import JobResult
from kvtier.connector.layerwise import LayerLoad, LayerSave
from kvtier.connector.namespace import checkpoint_digest, geometry_from_config, namespace_for_checkpoint
from kvtier.connector.pages import PAGE_LAYOUTS, PageLayout, gather_block, get_page_layout
from kvtier.connector.stats import ConnectorStats
from kvtier.connector.streams import Streams, cuda_streams, host_streams, streams_for

__all__ = [
    "PAGE_LAYOUTS", "ConnectorStats", "JobResult", "KVConnectorCore", "LayerLoad", "LayerSave", "PageLayout",
    "Streams", "checkpoint_digest", "cuda_streams", "default_address", "gather_block", "geometry_from_config",
    "get_page_layout", "host_streams", "namespace_for_checkpoint", "streams_for",
]
