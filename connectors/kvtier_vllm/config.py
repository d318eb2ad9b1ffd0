"""The connector's settings (``kv_connector_extra_config``) and the kvtier namespace of a vLLM engine.

Both of vLLM's connector instances (the scheduler's and each worker's) derive the namespace from
the same inputs, the engine's ``KVCacheConfig`` (block size, KV heads of this shard, head sizes,
dtype, layer names) and these settings, so the scheduler looks up exactly the keys its workers
save and load.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier_protocol.block import dtype_name
from kvtier_protocol.errors import InvalidRequest, LayoutError
from kvtier_protocol.namespace import Namespace

from kvtier.connector import checkpoint_digest, default_address

log = logging.getLogger("kvtier.vllm")

LOAD_MODES = ("async", "sync")
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_TYPES: dict[str, tuple[type, ...]] = {
    "address": (str,), "token": (str,), "token_file": (str,), "timeout_s": (int, float), "codec": (str,),
    "load_mode": (str,), "save_decode": (bool,), "priority": (int,), "model": (str,), "revision": (str,),
    "tenant_salt": (str,), "kv_events": (bool,), "layerwise": (bool,), "accept_lossy": (bool,),
}


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """``kv_connector_extra_config`` keys of :class:`kvtier_vllm.KVTierConnector`.

    Attributes:
        address: the daemon, ``"unix:/path"`` (shared-memory path) or ``"tcp://host:port"``;
            None: ``$KVTIER_SOCKET`` or the daemon's default socket.
        token: the daemon's token (TCP); ``token_file`` reads it from a file instead.
        timeout_s: bound on each daemon call; past it a lookup is a miss and a load recomputes.
        codec: how saved blocks are stored (``"raw"``, ``"int8"``, ``"int4"``, ``"fp8_e4m3"``...).
        load_mode: ``"async"`` (the request waits, off the forward path, until its load is
            reported) or ``"sync"`` (loaded before the step's forward).
        save_decode: also save blocks filled by generated tokens (default: prompt blocks only).
        priority: eviction priority of saved blocks, -128..127.
        model: model id in the namespace; None: vLLM's ``served_model_name`` or ``model``.
        revision: weights revision in the namespace; None: a digest of a local checkpoint
            directory, else the model config's revision.
        tenant_salt: tenant isolation salt of the namespace.
        kv_events: re-emit saved blocks as ``BlockStored(medium="CPU")`` through vLLM's own
            KV-event publisher (off by default: the daemon publishes its tiers itself).
        layerwise: move KV layer by layer, overlapped with the forward (default): ``sync`` loads
            are placed one layer at a time (``wait_for_layer_load`` waits for its layer only) and
            saves copy each layer out in ``save_kv_layer``; False: whole blocks before and after
            the forward (CUDA graphs then need no piecewise split).
        accept_lossy: False: only exact copies are hits (a block a lossy tier re-encoded, e.g. int8
            on disk, is recomputed); None: the daemon's default (``store.accept_lossy``).
    """

    address: str | None = None
    token: str | None = None
    token_file: str | None = None
    timeout_s: float = 2.0
    codec: str = "raw"
    load_mode: str = "async"
    save_decode: bool = False
    priority: int = 0
    model: str | None = None
    revision: str | None = None
    tenant_salt: str = ""
    kv_events: bool = False
    layerwise: bool = True
    accept_lossy: bool | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> KVTierConfig:
        """Parse ``kv_connector_extra_config``; unknown keys are refused (a typo must not pass silently).

        Raises:
            InvalidRequest: an unknown key, a wrong type or an invalid value.
        """
        extra = dict(extra or {})
        names = {f.name: f for f in dataclasses.fields(cls)}
        if unknown := sorted(set(extra) - set(names)):
            raise InvalidRequest(f"unknown kvtier kv_connector_extra_config keys {unknown}; known: {sorted(names)}")
        for key, value in extra.items():
            want = _TYPES[key] if value is not None or names[key].default is not None else (type(None),)
            if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
                raise InvalidRequest(f"kv_connector_extra_config[{key!r}] must be "
                                     f"{' or '.join(t.__name__ for t in want)}, got {value!r}")
        config = cls(**extra)
        if config.load_mode not in LOAD_MODES:
            raise InvalidRequest(f"load_mode must be one of {LOAD_MODES}, got {config.load_mode!r}")
        if not config.timeout_s > 0:
            raise InvalidRequest("timeout_s must be positive")
        return config

    def daemon_address(self) -> str:
        """The daemon address to connect to."""
        return self.address or default_address()

    def daemon_token(self) -> str | None:
        """The token, read from ``token_file`` if that is set.

        Raises:
            InvalidRequest: the token file cannot be read.
        """
        if self.token_file is None:
            return self.token
        try:
            with open(self.token_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as exc:
            raise InvalidRequest(f"cannot read token_file {self.token_file!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the namespace needs from vLLM's ``KVCacheConfig`` (its first KV-cache group).

    Attributes:
        layer_names: the attention layers of the group, in vLLM's order (a block stacks them so).
        block_size: tokens per vLLM block (the scheduler's block size).
        hash_block_size: tokens per entry of ``request.block_hashes``.
        mla: whether the group is MLA (one latent per token, no separate V).
        num_kv_heads, head_size, head_size_v: of this TP shard (MLA: 1, latent+rope, 0).
        dtype: the KV dtype's wire name.
    """

    layer_names: tuple[str, ...]
    block_size: int
    hash_block_size: int
    mla: bool
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str


def geometry_of(kv_cache_config: Any) -> Geometry:
    """The geometry of the first KV-cache group of vLLM's ``KVCacheConfig``.

    Raises:
        LayoutError: no attention group, several groups (hybrid models are not stored), or a
            KV dtype kvtier does not carry.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if len(groups) != 1:
        raise LayoutError(f"kvtier_vllm stores models with one KV-cache group (full attention or MLA); "
                          f"this engine has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if not hasattr(spec, "num_kv_heads"):
        raise LayoutError(f"KV-cache spec {type(spec).__name__} is not attention")
    block_size = int(spec.block_size)
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None) or block_size)
    mla = int(spec.head_size_v) == 0
    try:
        dtype = dtype_name(spec.dtype)
    except Exception as exc:  # CodecError: e.g. fp8 caches allocated as uint8
        raise LayoutError(f"KV dtype {spec.dtype} is not stored by kvtier: {exc}") from None
    return Geometry(tuple(groups[0].layer_names), block_size, hash_block_size, mla, int(spec.num_kv_heads),
                    int(spec.head_size), int(spec.head_size_v), dtype)


def _text_config(vllm_config: Any) -> Any:
    model_config = getattr(vllm_config, "model_config", None)
    return getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)


def model_identity(vllm_config: Any, config: KVTierConfig) -> tuple[str, str]:
    """``(model, revision)`` of the namespace: the settings' values, else vLLM's model config's.

    A local checkpoint directory is identified by :func:`checkpoint_digest` of its weights, so
    KV of changed weights is never served.
    """
    mc = vllm_config.model_config
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    model = config.model or served or mc.model
    revision = config.revision
    if revision is None and os.path.isdir(mc.model):
        revision = checkpoint_digest(mc.model)
    if revision is None:
        revision = getattr(mc, "revision", None)
    if revision is None:
        revision = "main"
        log.warning("kvtier namespace of %s uses revision %r; set kv_connector_extra_config.revision "
                    "to the weights' commit so that KV of other weights is never served", model, revision)
    return str(model), str(revision)


def check_hash_algo(vllm_config: Any, env: Mapping[str, str] | None = None) -> str:
    """vLLM's ``--prefix-caching-hash-algo``, refused where its keys would not survive a restart.

    Raises:
        InvalidRequest: an xxhash algorithm without ``PYTHONHASHSEED`` (vLLM then seeds its
            chain per process, so no key could ever hit again), or an unknown algorithm.
    """
    env = os.environ if env is None else env
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
    if algo not in HASH_ALGOS:
        raise InvalidRequest(f"unknown prefix_caching_hash_algo {algo!r}")
    if algo.startswith("xxhash") and env.get("PYTHONHASHSEED") is None:
        raise InvalidRequest(f"--prefix-caching-hash-algo {algo} seeds block hashes per process without "
                             "PYTHONHASHSEED; use sha256_cbor (or set PYTHONHASHSEED on every engine)")
    return algo


def namespace_for(vllm_config: Any, geometry: Geometry, config: KVTierConfig, *, tp_rank: int) -> Namespace:
    """The namespace of TP rank ``tp_rank``'s KV. MLA KV is the same on every rank: one namespace.

    Raises:
        NamespaceError: fields the namespace refuses. InvalidRequest: pipeline parallelism.
    """
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) != 1:
        raise InvalidRequest("kvtier_vllm supports pipeline_parallel_size 1")
    model, revision = model_identity(vllm_config, config)
    tp_size = 1 if geometry.mla else int(parallel.tensor_parallel_size)
    if geometry.mla:
        rope = int(getattr(_text_config(vllm_config), "qk_rope_head_dim", 0) or 0)
        dims = {"num_kv_heads": 1, "head_dim": geometry.head_size - rope, "mla_rope_dim": rope}
    else:
        dims = {"num_kv_heads": geometry.num_kv_heads, "head_dim": geometry.head_size,
                "head_dim_v": geometry.head_size_v}
    return Namespace(model=model, revision=revision, attention="mla" if geometry.mla else "mha",
                     num_layers=len(geometry.layer_names), kv_dtype=geometry.dtype, kv_codec=config.codec,
                     block_tokens=geometry.block_size, hash_tokens=geometry.hash_block_size,
                     tp_rank=0 if geometry.mla else tp_rank, tp_size=tp_size, tenant_salt=config.tenant_salt,
                     **dims)
