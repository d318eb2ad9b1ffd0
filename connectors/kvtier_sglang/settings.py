"""The backend's options (from ``--hicache-storage-backend-extra-config``) and its namespace.

SGLang passes the whole extra-config map to the backend; the keys SGLang itself reads
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ...) are left alone, and
these are ours::

    address      the daemon: "unix:/run/kvtier/kvtier.sock" or "tcp://host:port" (default: the
                 daemon's own default socket, $KVTIER_SOCKET first)
    token        the daemon's token (TCP only)
    timeout_s    bound on each daemon call (default 2.0); past it a call answers misses
    codec        how pages are stored: "raw" (default), "int8", "int4", "fp8_e4m3", ...
    model        model id in the namespace (default: SGLang's model name)
    revision     weights revision; required unless model_path (or the model name) is a local
                 checkpoint directory, whose weight files are then digested
    model_path   a local checkpoint directory to digest for the revision
    tenant_salt  tenant isolation salt (default "": none)
    priority     eviction priority of stored pages, -128..127 (default 0)
    accept_lossy false: exact copies only (a page a lossy tier re-encoded, e.g. int8 on disk, is
                 a miss); default: the daemon's (store.accept_lossy)

The namespace names the KV of this rank's shard: MHA carries ``tp_rank``/``tp_size`` (each rank
holds its own heads), MLA is replicated over TP ranks so every rank reads ``tp 0/1`` and only the
storage writer (``HiCacheStorageConfig.is_storage_writer``) writes. Keys are SGLang's own page
hashes (``hash_scheme = "sglang-sha256-u32le"``, ``hash_tokens = block_tokens = page_size``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier_protocol.errors import InvalidRequest, NamespaceError
from kvtier_protocol.keys import SGLANG_SCHEME
from kvtier_protocol.namespace import Namespace

from kvtier.connector.namespace import checkpoint_digest
from kvtier_sglang.pages import PoolGeometry


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """Our keys of the extra config (see the module docstring)."""

    address: str | None = None
    token: str | None = None
    timeout_s: float = 2.0
    codec: str = "raw"
    model: str | None = None
    revision: str | None = None
    model_path: str | None = None
    tenant_salt: str = ""
    priority: int = 0
    accept_lossy: bool | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        """Our keys of SGLang's extra config; other keys are SGLang's and ignored.

        Raises:
            InvalidRequest: one of our keys has a value of the wrong type or range.
        """
        extra = dict(extra or {})
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in extra or extra[f.name] is None:
                continue
            v = extra[f.name]
            if f.name == "timeout_s":
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                v = float(v) if ok else v
            elif f.name == "priority":
                ok = type(v) is int and -128 <= v <= 127
            elif f.name == "accept_lossy":
                ok = type(v) is bool
            else:
                ok = isinstance(v, str)
            if not ok:
                raise InvalidRequest(f"extra config {f.name!r} has an invalid value {v!r}")
            values[f.name] = v
        return cls(**values)


def shard_of(config: Any) -> tuple[int, int, int, int]:
    """``(tp_rank, tp_size, pp_rank, pp_size)`` of the KV this rank stores.

    Raises:
        NamespaceError: a sharding kvtier's namespace cannot name: attention context parallel
            (each CP rank holds a slice of every page), decode context parallel, or split heads
            across heterogeneous TP sizes.
    """
    if getattr(config, "attn_cp_size", 1) > 1 or getattr(config, "dcp_size", 1) > 1:
        raise NamespaceError("kvtier does not store context-parallel shards (attn_cp_size or dcp_size > 1)")
    if getattr(config, "should_split_heads", False):
        raise NamespaceError("kvtier does not store pages split over heterogeneous TP sizes (tp_lcm_size)")
    pp = (int(config.pp_rank), int(config.pp_size))
    if config.is_mla_model:
        return (0, 1, *pp)  # MLA KV is the same on every TP rank: one shard, one writer
    return (int(config.tp_rank), int(config.tp_size), *pp)


def resolve_revision(settings: BackendSettings, model_name: str | None) -> str:
    """The weights revision: the configured one, else a digest of the local checkpoint.

    Raises:
        NamespaceError: no revision and no local checkpoint directory to digest (keys name token
            prefixes, not weights, so KV of other weights would otherwise be served).
    """
    if settings.revision:
        return settings.revision
    for path in (settings.model_path, model_name):
        if path and os.path.isdir(path):
            return checkpoint_digest(path)
    raise NamespaceError(f"set 'revision' (or 'model_path', a local checkpoint) in "
                         f"--hicache-storage-backend-extra-config: {model_name!r} is not a directory "
                         "whose weights kvtier can digest")


def build_namespace(settings: BackendSettings, config: Any, geometry: PoolGeometry, revision: str) -> Namespace:
    """The namespace of the pages this rank stores.

    Raises:
        NamespaceError: an unsupported sharding, or invalid fields.
        LayoutError: a pool dtype kvtier does not store.
    """
    tp_rank, tp_size, pp_rank, pp_size = shard_of(config)
    model = settings.model or getattr(config, "model_name", None) or "unknown"
    if geometry.attention == "mla":
        dims = {"num_kv_heads": 1, "head_dim": geometry.kv_lora_rank, "mla_rope_dim": geometry.rope_dim}
    else:
        dims = {"num_kv_heads": geometry.num_heads, "head_dim": geometry.head_dim}
    return Namespace(model=model, revision=revision, attention=geometry.attention, num_layers=geometry.num_layers,
                     kv_dtype=geometry.kv_dtype, kv_codec=settings.codec, block_tokens=geometry.page_tokens,
                     hash_tokens=geometry.page_tokens, hash_scheme=SGLANG_SCHEME, tp_rank=tp_rank, tp_size=tp_size,
                     pp_rank=pp_rank, pp_size=pp_size, tenant_salt=settings.tenant_salt, **dims)
