"""Namespaces: what makes KV of the same tokens interchangeable (SPEC.md §2). Torch-free.

Two blocks with equal chain hashes are the same KV only if the model, weights, attention
geometry, dtype, codec, block size, shard, hash scheme and tenant agree. A :class:`Namespace`
names all of them; its canonical encoding (RFC 8949 §4.2.1 deterministic CBOR of a map with
fixed text keys) is hashed to a 16-byte ``ns_id`` that prefixes every stored key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2

from kvtier_protocol.codec_plan import CODECS
from kvtier_protocol.dtypes import DTYPE_SIZES as ALL_DTYPE_SIZES
from kvtier_protocol.errors import NamespaceError
from kvtier_protocol.keys import DEFAULT_SCHEME, SCHEMES, ExtraKeys, block_keys, chain_hashes

NS_ID_LEN = 16
NS_DOMAIN = b"kvtier-ns-v1\x00"
"""Prefix of the hashed bytes: ``ns_id = sha256(NS_DOMAIN || canonical_bytes)[:16]``."""

ATTENTIONS = ("mha", "mla")
KV_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")
DTYPE_SIZES: dict[str, int] = {name: ALL_DTYPE_SIZES[name] for name in KV_DTYPES}
"""KV dtypes by name, with their element size in bytes (the floating subset of §6.1)."""
LOSSY_SOURCE_DTYPES = ("bfloat16", "float16", "float32")
"""Lossy codecs quantize floating KV of these dtypes; fp8 KV is stored raw only."""

MAX_TEXT_BYTES = 256  # model, revision, tenant_salt (UTF-8)
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 65536
MAX_BLOCK_TOKENS = 65536
MAX_PARALLEL = 65536  # tp_size, pp_size

_TEXT = ("model", "revision", "attention", "kv_dtype", "kv_codec", "hash_scheme", "tenant_salt")
_WIRE: tuple[tuple[str, type, bool], ...] = (
    ("model", str, True), ("revision", str, True), ("attention", str, True),
    ("num_layers", int, True), ("num_kv_heads", int, True), ("head_dim", int, True),
    ("head_dim_v", int, False), ("mla_rope_dim", int, False), ("kv_dtype", str, False),
    ("kv_codec", str, False), ("block_tokens", int, False), ("hash_tokens", int, False),
    ("hash_scheme", str, False), ("tp_rank", int, False), ("tp_size", int, False),
    ("pp_rank", int, False), ("pp_size", int, False), ("tenant_salt", str, False),
)
"""Every field: (wire key, msgpack/CBOR type, required on the wire)."""


@dataclass(frozen=True, slots=True)
class Namespace:
    """The identity of interchangeable KV.

    Attributes:
        model: model id, e.g. ``"meta-llama/Llama-3.1-8B"`` (1..256 UTF-8 bytes).
        revision: weights revision or digest (1..256 bytes); different weights, different KV.
        attention: ``"mha"`` (incl. GQA/MQA) or ``"mla"`` (one shared latent per token).
        num_layers: attention layers held by this shard (this pp stage).
        num_kv_heads: KV heads held by this shard (this tp rank); 1 for MLA.
        head_dim: K head dim; for MLA the latent width (``kv_lora_rank``).
        head_dim_v: V head dim; defaults to ``head_dim`` for MHA, must be 0 for MLA.
        mla_rope_dim: MLA's decoupled RoPE key dims stored after the latent; 0 for MHA.
        kv_dtype: the engine's KV dtype, a key of :data:`DTYPE_SIZES`.
        kv_codec: how blocks are stored, one of :data:`CODECS`. Lossy codecs are part of the
            namespace so that a consumer asking for raw KV never receives quantized KV.
        block_tokens: tokens per stored block, a multiple of ``hash_tokens``.
        hash_tokens: tokens per hash unit (the engine's prefix-hash granularity).
        hash_scheme: a name in :data:`kvtier_protocol.keys.SCHEMES`.
        tp_rank, tp_size, pp_rank, pp_size: the shard coordinate.
        tenant_salt: tenant isolation salt; ``""`` means none. It also enters unit 0's extra
            keys (``cache_salt``), so even a shared ns_id never shares a tenant's chain.
    """

    model: str
    revision: str
    attention: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None  # resolved in __post_init__; always an int afterwards
    mla_rope_dim: int = 0
    kv_dtype: str = "bfloat16"
    kv_codec: str = "raw"
    block_tokens: int = 16
    hash_tokens: int = 16
    hash_scheme: str = DEFAULT_SCHEME
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tenant_salt: str = field(default="", repr=False)  # a tenant secret stays out of logs
    _canonical: bytes = field(init=False, repr=False, compare=False, default=b"")
    _ns_id: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        for name in _TEXT:
            v = getattr(self, name)
            if not isinstance(v, str):
                raise NamespaceError(f"namespace.{name} must be a str, got {type(v).__name__}")
            try:
                n = len(v.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise NamespaceError(f"namespace.{name} is not valid Unicode") from exc
            if n > MAX_TEXT_BYTES:
                raise NamespaceError(f"namespace.{name} is longer than {MAX_TEXT_BYTES} bytes")
        if not self.model or not self.revision:
            raise NamespaceError("namespace.model and namespace.revision must not be empty")
        _one_of("attention", self.attention, ATTENTIONS)
        _one_of("kv_dtype", self.kv_dtype, tuple(DTYPE_SIZES))
        _one_of("kv_codec", self.kv_codec, CODECS)
        _one_of("hash_scheme", self.hash_scheme, tuple(SCHEMES))
        mla = self.attention == "mla"
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", 0 if mla else self.head_dim)
        _int("num_layers", self.num_layers, 1, MAX_LAYERS)
        _int("num_kv_heads", self.num_kv_heads, 1, 1 if mla else MAX_HEADS)
        _int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        _int("head_dim_v", self.head_dim_v, 0 if mla else 1, 0 if mla else MAX_HEAD_DIM)
        _int("mla_rope_dim", self.mla_rope_dim, 0, MAX_HEAD_DIM if mla else 0)
        _int("block_tokens", self.block_tokens, 1, MAX_BLOCK_TOKENS)
        _int("hash_tokens", self.hash_tokens, 1, self.block_tokens)
        if self.block_tokens % self.hash_tokens:
            raise NamespaceError("namespace.block_tokens must be a multiple of hash_tokens")
        _int("tp_size", self.tp_size, 1, MAX_PARALLEL)
        _int("tp_rank", self.tp_rank, 0, self.tp_size - 1)
        _int("pp_size", self.pp_size, 1, MAX_PARALLEL)
        _int("pp_rank", self.pp_rank, 0, self.pp_size - 1)
        if self.kv_codec != "raw" and self.kv_dtype not in LOSSY_SOURCE_DTYPES:
            raise NamespaceError(f"codec {self.kv_codec} needs kv_dtype in {LOSSY_SOURCE_DTYPES}")
        canonical = cbor2.dumps(self.to_wire(), canonical=True)
        object.__setattr__(self, "_canonical", canonical)
        object.__setattr__(self, "_ns_id", hashlib.sha256(NS_DOMAIN + canonical).digest()[:NS_ID_LEN])

    @property
    def ns_id(self) -> bytes:
        """16 bytes: ``sha256(b"kvtier-ns-v1\\x00" || canonical_bytes())[:16]``."""
        return self._ns_id

    def canonical_bytes(self) -> bytes:
        """The deterministic CBOR map of every field (SPEC.md §2.3); independent of dict order."""
        return self._canonical

    @property
    def units_per_block(self) -> int:
        """Hash units in one block."""
        return self.block_tokens // self.hash_tokens

    @property
    def dtype_size(self) -> int:
        """Bytes per element of ``kv_dtype``."""
        return DTYPE_SIZES[self.kv_dtype]

    def bytes_per_token(self, dtype_size: int | None = None) -> int:
        """Raw KV bytes of one token over all layers of this shard.

        MHA: ``L * H * (D + Dv) * esize`` (K and V); MLA: ``L * (latent + rope) * esize``.

        Args:
            dtype_size: element size to use instead of ``kv_dtype``'s (e.g. 1 for an int8 view).
        """
        esize = self.dtype_size if dtype_size is None else dtype_size
        assert self.head_dim_v is not None, "resolved in __post_init__"
        if self.attention == "mla":
            return self.num_layers * (self.head_dim + self.mla_rope_dim) * esize
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.head_dim_v) * esize

    def block_payload_bytes(self) -> int:
        """Bytes of one raw block in the canonical layout (``bytes_per_token * block_tokens``)."""
        return self.bytes_per_token() * self.block_tokens

    def extra_keys(self, **kwargs: Any) -> ExtraKeys:
        """:class:`ExtraKeys` for a request here: the tenant salt becomes unit 0's ``cache_salt``.

        Args:
            **kwargs: the other :class:`ExtraKeys` fields (lora_name, lora_path, mm_items,
                prompt_embeds).
        """
        return ExtraKeys(cache_salt=self.tenant_salt or None, **kwargs)

    def block_keys(self, tokens: Sequence[int], extras: ExtraKeys | None = None) -> list[bytes]:
        """Chain hashes naming the full blocks of ``tokens`` (from position 0) in this namespace.

        Raises:
            NamespaceError: ``extras.cache_salt`` is not this namespace's tenant salt.
        """
        extras = self.extra_keys() if extras is None else extras
        if extras.cache_salt != (self.tenant_salt or None):
            raise NamespaceError("extras.cache_salt must be the namespace's tenant_salt")
        units = chain_hashes(tokens, self.hash_tokens, scheme=self.hash_scheme, extras=extras)
        return block_keys(units, self.units_per_block)

    def to_wire(self) -> dict[str, Any]:
        """The namespace map carried in frames and headers: every field, fixed text keys."""
        return {name: getattr(self, name) for name, _, _ in _WIRE}

    @classmethod
    def from_wire(cls, m: Any) -> Namespace:
        """Parse an untrusted namespace map; unknown keys are ignored.

        Raises:
            NamespaceError: not a map, a required key missing, a wrong type, an invalid value.
        """
        if not isinstance(m, Mapping):
            raise NamespaceError("a namespace must be a map")
        kwargs: dict[str, Any] = {}
        for name, typ, required in _WIRE:
            if name not in m:
                if required:
                    raise NamespaceError(f"namespace.{name} is required")
                continue
            v = m[name]
            if type(v) is not typ:  # strict: no bool for int, no bytes for str
                raise NamespaceError(f"namespace.{name} must be {typ.__name__}")
            kwargs[name] = v
        return cls(**kwargs)


def _one_of(name: str, v: str, allowed: tuple[str, ...]) -> None:
    if v not in allowed:
        raise NamespaceError(f"namespace.{name} must be one of {allowed}, got {v!r}")


def _int(name: str, v: Any, lo: int, hi: int) -> None:
    if type(v) is not int or not lo <= v <= hi:
        raise NamespaceError(f"namespace.{name} must be an int in [{lo}, {hi}], got {v!r}")
