"""Block keys: prefix-chain hashing of token blocks (SPEC.md §3). Torch-free.

A prompt is cut into hash units of ``hash_tokens`` tokens; unit ``i`` gets
``h_i = H(h_{i-1}, tokens_i, extra_i)``, so one digest names the whole prefix up to its unit.
A stored block spans ``block_tokens / hash_tokens`` units and is keyed by its LAST unit's
digest. Two schemes exist, picked by the namespace:

* ``vllm-sha256-cbor`` (default): ``sha256(canonical_cbor((parent, tuple(tokens), extra)))``,
  byte-for-byte vLLM 0.33's ``sha256_cbor`` with its fixed default seed, extra keys included.
* ``sglang-sha256-u32le``: ``sha256(parent || u32le tokens)``, SGLang HiCache's page hash.

Nothing here depends on ``hash()`` or ``PYTHONHASHSEED``: keys must survive restarts.
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

from kvtier_protocol.errors import InvalidKey, InvalidRequest, NamespaceError

HASH_LEN = 32  # bytes in a chain hash of every registered scheme (SHA-256)

VLLM_SCHEME = "vllm-sha256-cbor"
SGLANG_SCHEME = "sglang-sha256-u32le"
DEFAULT_SCHEME = VLLM_SCHEME

VLLM_SEED = "vllm-none-hash"
"""vLLM's ``DEFAULT_NONE_HASH_SEED``: the parent of the first unit is ``sha256(cbor(seed))``."""

SGLANG_SEED_DOMAIN = b"sglang-cache-namespace-v1"
_U64 = 1 << 64
_I64 = 1 << 63  # SGLang's wide path rejects ids above INT64_MAX
_U32 = 1 << 32

ExtraKey = tuple[Any, ...]  # ("lora", name, path) | ("mm", id, offset) | ("cache_salt", s) | ...


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


NONE_HASH: bytes = hashlib.sha256(_cbor(VLLM_SEED)).digest()
"""Parent of the first unit in ``vllm-sha256-cbor`` (9bd96a48…81eef0)."""


@dataclass(frozen=True, slots=True)
class MMItem:
    """One multimodal item of a request, as vLLM's ``mm_features`` describes it.

    Attributes:
        identifier: the engine's content hash of the item (``mm_feature.identifier``).
        offset: index in the request of the item's first placeholder token.
        length: number of placeholder tokens (at least 1).
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not (_text(self.identifier) and _is_int(self.offset) and _is_int(self.length)
                and self.offset >= 0 and self.length >= 1):
            raise InvalidRequest("an mm item needs a str identifier, offset >= 0, length >= 1")


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Request-level inputs besides tokens that change the KV, turned into per-unit extra keys.

    Attributes:
        lora_name: LoRA adapter name, or None. For ``sglang-sha256-u32le`` this is SGLang's
            ``extra_key`` and enters the chain seed instead.
        lora_path: LoRA adapter path (vLLM hashes it next to the name so re-pointing a name at
            another adapter misses).
        mm_items: multimodal items sorted by offset.
        cache_salt: tenant salt; enters unit 0 only. ``""`` means none for vLLM; SGLang tells
            ``""`` from None, so pass None for "no salt".
        prompt_embeds: per-unit SHA-256 digests of the unit's prompt embeddings, unit 0 first;
            units past the end get no prompt-embeds key.
    """

    lora_name: str | None = None
    lora_path: str = ""
    mm_items: tuple[MMItem, ...] = ()
    cache_salt: str | None = None
    prompt_embeds: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if not (_text(self.lora_name, True) and _text(self.lora_path)
                and _text(self.cache_salt, True)):
            raise InvalidRequest("lora_name and cache_salt must be str or None, lora_path a str")
        if not (isinstance(self.mm_items, tuple)
                and all(isinstance(m, MMItem) for m in self.mm_items)):
            raise InvalidRequest("mm_items must be a tuple of MMItem")
        if any(a.offset > b.offset for a, b in zip(self.mm_items, self.mm_items[1:])):
            raise InvalidRequest("mm_items must be sorted by offset")
        if not isinstance(self.prompt_embeds, tuple) or any(
                not isinstance(d, bytes) or len(d) != HASH_LEN for d in self.prompt_embeds):
            raise InvalidRequest("prompt_embeds entries must be 32-byte digests")

    def for_unit(self, start: int, end: int) -> tuple[ExtraKey, ...] | None:
        """The extra keys of the unit covering tokens ``[start, end)``, exactly as vLLM 0.33's
        ``generate_block_hash_extra_keys``: lora, then mm items, then salt, then embeds."""
        if not (_is_int(start) and _is_int(end) and 0 <= start < end):
            raise InvalidRequest("a unit is [start, end) with 0 <= start < end")
        keys: list[ExtraKey] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path))
        for m in self.mm_items:  # vLLM's walk: skip passed items, stop at one that runs past end
            if end <= m.offset:
                break
            if start >= m.offset + m.length:
                continue
            keys.append(("mm", m.identifier, m.offset - start))
            if end < m.offset + m.length:
                break
        if start == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        unit = start // (end - start)
        if unit < len(self.prompt_embeds):
            keys.append(("prompt_embeds", self.prompt_embeds[unit]))
        return tuple(keys) if keys else None


def _text(v: Any, none_ok: bool = False) -> bool:
    if v is None or not isinstance(v, str):
        return v is None and none_ok
    try:
        v.encode("utf-8")  # lone surrogates have no UTF-8 form, so they cannot be hashed
    except UnicodeEncodeError:
        return False
    return True


def _is_int(v: Any) -> bool:
    return type(v) is int  # excludes bool and int subclasses, which cbor2 may encode otherwise


def _check_tokens(tokens: Sequence[int], limit: int) -> tuple[int, ...]:
    try:
        tup = tuple(tokens)
    except TypeError as exc:
        raise InvalidKey("tokens must be a sequence of ints") from exc
    if tup:
        if not set(map(type, tup)) <= {int}:
            raise InvalidKey("token ids must be plain ints")
        if min(tup) < 0 or max(tup) >= limit:
            raise InvalidKey(f"token ids must be in [0, {limit})")
    return tup


def check_chain_hash(b: Any, scheme: str = DEFAULT_SCHEME) -> bytes:
    """Return ``b`` if it is a chain hash of ``scheme`` (32 bytes), else raise InvalidKey."""
    get_scheme(scheme)
    if not isinstance(b, bytes) or len(b) != HASH_LEN:
        raise InvalidKey(f"a {scheme} chain hash is {HASH_LEN} bytes")
    return b


class BlockHasher(ABC):
    """A hash scheme: how a unit's digest follows from its parent, tokens and extra keys."""

    __slots__ = ()
    name: str
    none_hash: bytes | None  # the implicit parent of unit 0; None: no parent bytes at all
    max_token: int  # token ids must be below this

    def preimage(self, parent: bytes | None, tokens: Sequence[int], extra: Any = None) -> bytes:
        """The exact bytes hashed for one unit (parent None: the first unit)."""
        return self._encode(parent, _check_tokens(tokens, self.max_token), extra)

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: Any = None) -> bytes:
        """The digest of one unit: SHA-256 of :meth:`preimage`."""
        return hashlib.sha256(self.preimage(parent, tokens, extra)).digest()

    def first_parent(self, extras: ExtraKeys | None) -> bytes | None:
        """The parent given to unit 0: a seed derived from ``extras``, or None."""
        return None

    def unit_extra(self, extras: ExtraKeys | None, start: int, end: int) -> Any:
        """The extra keys of the unit covering ``[start, end)``."""
        return None

    @abstractmethod
    def _encode(self, parent: bytes | None, tokens: tuple[int, ...], extra: Any) -> bytes:
        """Preimage of already validated tokens."""


class VllmSha256Cbor(BlockHasher):
    """``vllm-sha256-cbor``: SHA-256 over deterministic CBOR of ``(parent, tokens, extra)``."""

    __slots__ = ()
    name = VLLM_SCHEME
    none_hash = NONE_HASH
    max_token = _U64

    def unit_extra(self, extras: ExtraKeys | None, start: int, end: int) -> Any:
        return extras.for_unit(start, end) if extras is not None else None

    def _encode(self, parent: bytes | None, tokens: tuple[int, ...], extra: Any) -> bytes:
        parent = NONE_HASH if not parent else check_chain_hash(parent, self.name)  # as vLLM
        if extra is not None and not isinstance(extra, tuple):
            raise InvalidKey("extra keys must be a tuple or None")
        try:
            return _cbor((parent, tokens, extra))
        except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
            raise InvalidKey(f"extra keys are not CBOR-encodable: {exc}") from exc


class SglangSha256U32le(BlockHasher):
    """``sglang-sha256-u32le``: SGLang HiCache's page hash (``hash_binding.cpp``).

    ``sha256(parent? || u32le ids)``; a unit holding any id >= 2^32 hashes
    ``parent? || 0xFF || u64le ids`` instead (the odd length keeps it apart from u32 pages).
    LoRA (SGLang's ``extra_key``) and the salt enter through the seed, never per unit.
    """

    __slots__ = ()
    name = SGLANG_SCHEME
    none_hash = None
    max_token = _I64

    def first_parent(self, extras: ExtraKeys | None) -> bytes | None:
        if extras is None:
            return None
        if extras.mm_items or extras.prompt_embeds:
            raise InvalidRequest("sglang-sha256-u32le cannot hash multimodal or embeds keys")
        return sglang_namespace_seed(extras.lora_name, extras.cache_salt)

    def _encode(self, parent: bytes | None, tokens: tuple[int, ...], extra: Any) -> bytes:
        if extra is not None:
            raise InvalidRequest("sglang-sha256-u32le takes no per-unit extra keys; use the seed")
        prior = b"" if parent is None else check_chain_hash(parent, self.name)
        if tokens and max(tokens) >= _U32:
            return prior + b"\xff" + struct.pack(f"<{len(tokens)}Q", *tokens)
        return prior + struct.pack(f"<{len(tokens)}I", *tokens)


def sglang_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """SGLang's ``storage_namespace_seed`` as raw bytes: the prior digest of page 1, or None.

    ``sha256(domain || part(extra_key) || part(cache_salt))`` with ``part(None) = 00`` and
    ``part(s) = 01 || u64le(len(utf8(s))) || utf8(s)``.
    """
    if extra_key is None and cache_salt is None:
        return None
    h = hashlib.sha256(SGLANG_SEED_DOMAIN)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
            continue
        enc = part.encode("utf-8")
        h.update(b"\x01" + len(enc).to_bytes(8, "little") + enc)
    return h.digest()


SCHEMES: dict[str, BlockHasher] = {VLLM_SCHEME: VllmSha256Cbor(), SGLANG_SCHEME: SglangSha256U32le()}
"""Registry of hash schemes by namespace name."""


def get_scheme(name: str) -> BlockHasher:
    """The hasher registered as ``name``; NamespaceError if there is none."""
    hasher = SCHEMES.get(name) if isinstance(name, str) else None
    if hasher is None:
        raise NamespaceError(f"unknown hash scheme {name!r}; known: {sorted(SCHEMES)}")
    return hasher


def hash_block_tokens(parent: bytes | None, tokens: Sequence[int], extra: Any = None, *,
                      scheme: str = DEFAULT_SCHEME) -> bytes:
    """One chain step: the digest of ``tokens`` (plain ints in [0, 2^64); SGLang [0, 2^63)) and
    ``extra`` (a tuple from :meth:`ExtraKeys.for_unit`, or None) after ``parent`` (None first).

    Raises:
        InvalidKey: bad token ids, parent or extra keys. NamespaceError: unknown scheme.
    """
    return get_scheme(scheme).hash_block(parent, tokens, extra)


def chain_hashes(tokens: Sequence[int], hash_tokens: int, *, scheme: str = DEFAULT_SCHEME,
                 extras: ExtraKeys | None = None, parent: bytes | None = None,
                 start: int = 0) -> list[bytes]:
    """Digests of every FULL hash unit of ``tokens``; a trailing partial unit is ignored.

    Args:
        tokens: token ids; ``tokens[0]`` sits at position ``start`` of the request.
        hash_tokens: tokens per hash unit (vLLM's hash block size, 16 by default).
        scheme: a name in :data:`SCHEMES`.
        extras: request-level extra keys, or None.
        parent: digest of the unit before ``start`` when continuing a chain; None iff start == 0.
        start: absolute position of ``tokens[0]``, a multiple of ``hash_tokens``.
    """
    hasher = get_scheme(scheme)
    if not _is_int(hash_tokens) or hash_tokens < 1:
        raise InvalidRequest("hash_tokens must be a positive int")
    if not _is_int(start) or start < 0 or start % hash_tokens:
        raise InvalidRequest("start must be a non-negative multiple of hash_tokens")
    if (parent is None) != (start == 0):
        raise InvalidRequest("parent must be given exactly when continuing a chain (start > 0)")
    try:
        n = len(tokens) // hash_tokens
        tup = _check_tokens(tokens[: n * hash_tokens], hasher.max_token)
    except TypeError as exc:
        raise InvalidKey("tokens must be a sequence of ints") from exc
    if start == 0:
        parent = hasher.first_parent(extras)
    out: list[bytes] = []
    for i in range(n):
        pos = start + i * hash_tokens
        extra = hasher.unit_extra(extras, pos, pos + hash_tokens)
        unit = tup[i * hash_tokens : (i + 1) * hash_tokens]
        parent = hashlib.sha256(hasher._encode(parent, unit, extra)).digest()
        out.append(parent)
    return out


def block_keys(unit_hashes: Sequence[bytes], units_per_block: int, first_unit: int = 0) -> list[bytes]:
    """Keys of the full blocks: the digest of each block's LAST unit; a trailing partial block has
    no key. Blocks are counted from the request's first token (SPEC.md §3.1): ``unit_hashes[0]``
    is unit ``first_unit`` of the request (a continuation's ``start // hash_tokens``), and unit
    ``i`` is a key exactly when ``(i + 1) % units_per_block == 0``, so a continuation that starts
    mid-block yields the key of the block it completes."""
    if not _is_int(units_per_block) or units_per_block < 1:
        raise InvalidRequest("units_per_block must be a positive int")
    if not _is_int(first_unit) or first_unit < 0:
        raise InvalidRequest("first_unit must be a non-negative int")
    return list(unit_hashes[(units_per_block - 1 - first_unit) % units_per_block :: units_per_block])


def event_hash(digest: bytes) -> int:
    """vLLM's u64 event form of a digest: its last 8 bytes, big-endian, unsigned."""
    if not isinstance(digest, bytes) or len(digest) < 8:
        raise InvalidKey("a digest has at least 8 bytes")
    return int.from_bytes(digest[-8:], "big")


def event_extra_keys(extra: tuple[ExtraKey, ...] | None) -> tuple[Any, ...] | None:
    """vLLM's untagged event form (``to_event_extra_keys``): ``(id, offset)`` for mm items,
    the second element for the others (lora name, salt, embeds digest)."""
    if extra is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in extra)


def to_hex(digest: bytes) -> str:
    """SGLang's page-key form: 64 lowercase hex characters."""
    return check_chain_hash(digest).hex()


def from_hex(s: Any) -> bytes:
    """Inverse of :func:`to_hex`; InvalidKey unless ``s`` is 64 lowercase hex characters."""
    if not isinstance(s, str) or len(s) != 2 * HASH_LEN or not set(s) <= _HEX_DIGITS:
        raise InvalidKey("a hex chain hash is 64 lowercase hex characters")
    return bytes.fromhex(s)


_HEX_DIGITS = frozenset("0123456789abcdef")
