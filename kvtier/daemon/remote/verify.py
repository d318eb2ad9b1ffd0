"""Judging a value read back from a remote tier: untrusted bytes until proven to be the block asked for.

Any host (or anyone with write access to the cluster) could have written any bytes under a kvtier
key: a truncated upload, a record of another block or namespace, garbage. A value becomes a hit
only when it decodes as one whole record (SPEC.md §4: preamble, header checksum, header map), its
payload matches the header's length and xxh3-64, and the header names exactly the key's namespace
and chain hash (and, when the namespace is known, fits its geometry). Anything else is a typed
miss the caller counts and deletes. Torch-free, no I/O.

Precision by tier (issue 25): a daemon with a lossy remote codec (``[tiers.remote] codec``)
uploads raw float KV re-encoded, so a record's codec may differ from its namespace's
``kv_codec``. Such a record is accepted only as a re-encoding the tiers produce: of a raw
namespace, with one of the quantizing codecs, in the canonical layout, its sections exactly those
the codec's plan gives for the namespace's shape and dtype (so the engine's decoder reads no byte
outside them and builds no tensor but the namespace's), MLA rope dims those of the namespace, a
compression stage only of a known algorithm. Its header says the codec, so the store serves it only
to requests that accept lossy copies. What no check can see is a forged record's values (scales
included): a writer of the cluster could store any raw KV too; the checksum guards integrity, not
honesty, and the cluster's ACLs guard who writes.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import cbor2

from kvtier_protocol.codec_plan import CODECS, plan_codec
from kvtier_protocol.compression import ALGORITHMS
from kvtier_protocol.errors import ChecksumMismatch, KVTierError, LimitExceeded, NamespaceError, Truncated
from kvtier_protocol.header import DEFAULT_MAX_PAYLOAD_LEN, BlockHeader, split_record, verify_payload
from kvtier_protocol.layouts import Layout, get_layout
from kvtier_protocol.namespace import NS_DOMAIN, Namespace

from kvtier.daemon.remote.backend import RemoteKey


class MissReason(enum.Enum):
    """Why a fetched value is not a hit; ``value`` is the metrics label."""

    TRUNCATED = "truncated"  # shorter than its preamble, header map or declared payload
    BAD_HEADER = "bad_header"  # wrong magic or version, header checksum, map, or trailing bytes
    TOO_LARGE = "too_large"  # declares a header or payload beyond the limits
    BAD_CHECKSUM = "bad_checksum"  # the payload's xxh3-64 differs from the header's
    WRONG_BLOCK = "wrong_block"  # a whole, valid record, of another namespace or chain hash
    WRONG_GEOMETRY = "wrong_geometry"  # the key's block, but not in its namespace's shape/dtype/codec


@dataclass(frozen=True, slots=True)
class Verdict:
    """The judgement of one value.

    Attributes:
        header: the decoded header when the value is a hit, else None.
        payload: a zero-copy view of the verified payload (into the value) when a hit, else None.
        reason: None for a hit, else why not.
        detail: a short human-readable account of the reason (for a debug log), "" for a hit.
    """

    header: BlockHeader | None
    payload: memoryview | None
    reason: MissReason | None
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Whether the value is the block asked for."""
        return self.reason is None


def _miss(reason: MissReason, detail: str) -> Verdict:
    return Verdict(None, None, reason, detail)


def verify_record(key: RemoteKey, value: bytes | bytearray | memoryview, *,
                  namespace: Namespace | None = None,
                  max_payload_len: int = DEFAULT_MAX_PAYLOAD_LEN) -> Verdict:
    """Judge ``value`` as the record of ``key``.

    Args:
        key: the key it was read under.
        value: the bytes read.
        namespace: the key's namespace when known: the block's tokens, dtype, codec and layout
            geometry must then fit it (a header that names the right key can still lie about them).
        max_payload_len: refuse larger declared payloads before looking at them.

    Never raises for any bytes: every failure is a verdict.
    """
    try:
        header, payload = split_record(value, max_payload_len=max_payload_len)
    except Truncated as e:
        return _miss(MissReason.TRUNCATED, str(e))
    except LimitExceeded as e:
        return _miss(MissReason.TOO_LARGE, str(e))
    except KVTierError as e:  # BadMagic, UnsupportedVersion, HeaderError, a header ChecksumMismatch
        return _miss(MissReason.BAD_HEADER, f"{type(e).__name__}: {e}")
    # Cheap identity first: a record of another block is refused without hashing megabytes.
    if header.ns_id != key.ns_id or header.chain_hash != key.chain_hash:
        other = "namespace" if header.ns_id != key.ns_id else "chain hash"
        return _miss(MissReason.WRONG_BLOCK, f"the record is of another {other}")
    try:
        verify_payload(header, payload)
    except Truncated as e:  # split_record already saw the whole payload; kept for clarity
        return _miss(MissReason.TRUNCATED, str(e))
    except ChecksumMismatch as e:
        return _miss(MissReason.BAD_CHECKSUM, str(e))
    if namespace is not None:
        problem = _geometry_problem(header, namespace)
        if problem:
            return _miss(MissReason.WRONG_GEOMETRY, problem)
    return Verdict(header, payload, None)


def _geometry_problem(h: BlockHeader, ns: Namespace) -> str:
    """What in ``h`` contradicts ``ns`` ("" when nothing does).

    The same rules as the store's commit check (``kvtier.daemon.store.validation.check_geometry``),
    restated here so the remote tier does not reach into the store it sits below.
    """
    try:
        layout = get_layout(h.layout)
        g = layout.geometry_of(h.shape)
    except KVTierError as e:
        return f"layout: {e}"
    if h.num_tokens != ns.block_tokens:
        return f"{h.num_tokens} tokens, namespace blocks hold {ns.block_tokens}"
    if h.dtype != ns.kv_dtype:
        return f"dtype {h.dtype}, namespace kv_dtype {ns.kv_dtype}"
    if layout.is_mla != (ns.attention == "mla"):
        return f"layout {h.layout} does not fit attention {ns.attention}"
    if g.num_layers != ns.num_layers:
        return f"{g.num_layers} layers, namespace has {ns.num_layers}"
    if layout.is_mla:
        if g.latent_dim != ns.head_dim + ns.mla_rope_dim:
            return f"latent {g.latent_dim}, namespace has {ns.head_dim}+{ns.mla_rope_dim}"
    elif (g.num_heads, g.head_dim, g.head_dim) != (ns.num_kv_heads, ns.head_dim, ns.head_dim_v):
        return f"{g.num_heads} heads x {g.head_dim} dims, namespace has {ns.num_kv_heads} x {ns.head_dim}"
    if h.codec != ns.kv_codec:  # last: the geometry above is the namespace's, whatever the codec
        return _recoding_problem(h, ns, layout)
    return ""


RECODINGS = tuple(c for c in CODECS if c != "raw")
"""The codecs a tier may re-encode a raw namespace's records with (``[tiers.*] codec``)."""


def _recoding_problem(h: BlockHeader, ns: Namespace, layout: Layout) -> str:
    """What keeps ``h``, whose codec is not its namespace's, from being a re-encoding the tiers
    produce ("" when nothing does; see the module docstring). The caller checked the geometry."""
    mismatch = f"codec {h.codec}, namespace kv_codec {ns.kv_codec}"
    if ns.kv_codec != "raw" or h.codec not in RECODINGS:
        return mismatch + " (tiers re-encode raw KV only, with one of " + ", ".join(RECODINGS) + ")"
    if layout.name != layout.canonical_name:  # the codecs read canonical layouts only (SPEC 5.1)
        return f"{mismatch}: layout {h.layout} is not canonical"
    if h.quant is None or (layout.is_mla and h.quant.rope_dims != ns.mla_rope_dim):
        return f"{mismatch}: quant parameters do not fit the namespace"
    if h.compression is not None and h.compression.alg not in ALGORITHMS:
        return f"{mismatch}: unknown compression {h.compression.alg!r:.40}"
    try:
        plan = plan_codec(h.codec, h.quant, h.shape, h.dtype, layout.is_mla).lengths()
    except KVTierError as e:
        return f"{mismatch}: {e}"
    # Before compression, each section is exactly as long as the plan says: the decoder then
    # reads no byte outside the record and decodes to the header's (the namespace's) shape.
    lengths = [n for _, n in h.compression.sections] if h.compression is not None else [s.length for s in h.sections]
    if [name for name, _ in plan] != [s.name for s in h.sections] or [n for _, n in plan] != lengths:
        return f"{mismatch}: sections do not follow the codec's plan"
    return ""


def verify_namespace(ns_id: bytes, value: bytes | bytearray | memoryview) -> Namespace | None:
    """The namespace whose canonical bytes ``value`` claims to be, if they hash to ``ns_id``
    (SPEC.md §2.4: ``sha256(NS_DOMAIN || canonical)[:16]``) and decode to a valid namespace;
    None otherwise. Never raises for any bytes."""
    raw = bytes(value)
    if hashlib.sha256(NS_DOMAIN + raw).digest()[:len(ns_id)] != ns_id:
        return None
    try:
        ns = Namespace.from_wire(cbor2.loads(raw))
    except (NamespaceError, ValueError, TypeError, KeyError, cbor2.CBORDecodeError, RecursionError):
        return None
    except KVTierError:
        return None
    # The hash matched the bytes; the bytes must also be this namespace's own encoding.
    return ns if ns.ns_id == ns_id and ns.canonical_bytes() == raw else None
