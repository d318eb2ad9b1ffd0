"""Blocking copy-and-verify steps of the tier moves; the store runs each on its I/O thread pool.

Every function copies first and verifies the copy, so the bytes that land in the destination (or
are handed to the disk) are exactly the bytes that were checked against the header checksum.

torch is imported only by the GPU functions and :func:`recode_verified`, and only when they run:
a store without a GPU tier or a lossy disk codec never loads it through this module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier_protocol.errors import KVTierError
from kvtier_protocol.header import copy_checksummed, decode_header, payload_checksum, verify_payload
from kvtier_protocol.layouts import get_layout

from kvtier.daemon.store.config import CodecModels, codec_for_model, tier_quant
from kvtier.daemon.store.disk_io import BufferPool, copy_into
from kvtier.daemon.store.types import BlockKey, Slot

if TYPE_CHECKING:
    from kvtier_protocol.namespace import Namespace

    from kvtier.daemon.store.disk import DiskTier
    from kvtier.daemon.store.gpu import GpuTier
    from kvtier.daemon.store.host import HostTier


def snapshot_verified(views: list[memoryview], checksums: list[int],
                      pool: BufferPool | None = None) -> list[memoryview | bytes | None]:
    """Copy each view and verify the copy: the bytes written down are exactly the bytes checked.

    With a ``pool`` (the disk tier's), each copy is a page-aligned buffer of it, which the disk
    tier writes with O_DIRECT in place; the caller gives it back after the write. Else ``bytes``.
    """
    out: list[memoryview | bytes | None] = []
    for view, checksum in zip(views, checksums):
        if pool is None:
            data: memoryview | bytes = bytes(view)
        else:
            data = pool.get(view.nbytes)
            copy_into(data, view)
        if payload_checksum(data) == checksum:
            out.append(data)
        else:
            out.append(None)
            if pool is not None:
                pool.give_back(data)
    return out


RECODE_DTYPES = frozenset({"bfloat16", "float16", "float32"})
"""Dtypes of the raw records a lossy tier codec re-encodes (the codecs' C loops read these)."""


def recode_choice(header: bytes, namespace: Callable[[bytes], Namespace | None], default: str,
                  models: CodecModels) -> tuple[int, str] | None:
    """How a tier re-encodes the record of ``header`` (issue 25): ``(rope_dims, codec)``, the MLA
    rope dims kept raw (0 for MHA) and the tier's codec for the block's model; or None when the
    record goes down (or up) as it is.

    The codec is the first of the tier's ``models`` whose pattern matches the block's namespace
    model (:func:`~kvtier.daemon.store.config.codec_for_model`), else ``default``; the model and
    the MLA rope dims come from ``namespace(ns_id)`` (registered, saved with the disk tier or
    learnt), else from the header's ``ns_fields``. None: the codec is raw; the record is not raw
    (uncompressed) float16/bfloat16/float32 KV; MLA rope dims unknown (quantizing them could cost
    more than the codec says).
    """
    try:
        h, _ = decode_header(header)
        mla = get_layout(h.layout).is_mla
    except KVTierError:  # never expected: committed headers were checked
        return None
    if h.codec != "raw" or h.compression is not None or h.dtype not in RECODE_DTYPES:
        return None
    ns = namespace(h.ns_id) if mla or models else None
    fields = h.ns_fields or {}
    model = ns.model if ns is not None else fields.get("model")
    codec = codec_for_model(models, default, model if isinstance(model, str) else None)
    if codec == "raw":
        return None
    rope = 0
    if mla:
        rope = ns.mla_rope_dim if ns is not None else fields.get("mla_rope_dim")
        if type(rope) is not int or rope < 0:
            return None
    return rope, codec


@dataclass(frozen=True, slots=True)
class Recoded:
    """A host record made ready for the disk by :func:`recode_verified` (issue 25).

    Attributes:
        header: the record's header: a new one (the disk codec, its scales' parameters, the new
            checksum; same key, namespace, parent, tokens) or, for a block the codec refuses,
            the old one.
        payload: the payload, in a buffer of the disk tier's pool (given back after the write).
        checksum: the xxh3-64 of ``payload``, which it was checked against after the copy.
        lossy: whether ``header`` names a codec other than raw.
    """

    header: bytes
    payload: memoryview
    checksum: int
    lossy: bool

    @property
    def size(self) -> int:
        """Payload bytes: what a memory slot holding this record needs."""
        return self.payload.nbytes


def recode_verified(items: list[tuple[bytes, memoryview, int, int, str]], k_axis: str, compression: str | None,
                    pool: BufferPool) -> list[Recoded | None]:
    """Re-encode raw host records for a lower tier (issue 25), each with its codec, then ``compression``.

    Per ``(header, host view, checksum, rope_dims, codec)`` (:func:`recode_choice`): the host
    payload is copied into this thread's scratch buffer, hashed as it is copied, and checked
    against ``checksum`` first (None: it fails; nothing is made of it), so a client writing to its
    shared memory meanwhile cannot make the daemon encode unverified bytes; the copy is read as
    the header's raw tensor (layout, shape, dtype) and encoded into a new record of the same block
    (:func:`kvtier_protocol.block.encode_block_into`: canonical layout, the codec's default
    parameters but K's axis, ``k_axis`` for MHA int codecs
    (:func:`~kvtier.daemon.store.config.tier_quant`), ``rope_dims`` trailing MLA latent dims kept
    raw) whose payload is written straight into a buffer of ``pool``: the new header's checksum is
    that of the buffer itself, so the bytes handed to the disk are the bytes hashed. A block the
    codec refuses (NaN or Inf, a layout it cannot read) keeps its record: the verified copy under
    the old header, copied into a pool buffer and checked there. The caller checked each header is
    raw float KV.
    """
    import torch  # noqa: PLC0415  (a store without a lossy disk codec never loads torch here)

    from kvtier_protocol.block import encode_block_into, torch_dtype  # noqa: PLC0415  (imports torch)

    out: list[Recoded | None] = []
    for header, view, checksum, rope_dims, codec in items:
        copy = _scratch(view.nbytes)
        if copy_checksummed(view, copy) != checksum:
            out.append(None)
            continue
        h, _ = decode_header(header)
        # a view of the scratch buffer: the encoder reads it before this thread copies anything else there
        tensor = torch.frombuffer(copy, dtype=torch.uint8).view(torch_dtype(h.dtype)).reshape(h.shape)
        taken: list[memoryview] = []

        def alloc(nbytes: int) -> memoryview:
            taken.append(buf := pool.get(nbytes))
            return buf

        try:
            quant = tier_quant(codec, k_axis, mla=get_layout(h.layout).is_mla)
            new_header, payload, new_checksum = encode_block_into(
                tensor, alloc=alloc, ns_id=h.ns_id, chain_hash=h.chain_hash, parent_hash=h.parent_hash,
                layout=h.layout, codec=codec, quant=quant, num_tokens=h.num_tokens,
                ns_fields=dict(h.ns_fields) if h.ns_fields is not None else None, created_ms=h.created_ms,
                mla_rope_dim=rope_dims, compression=compression)
        except KVTierError:  # data the codec refuses: the block goes down exact, as it is
            for buf in taken:
                pool.give_back(buf)
            out.append(_pooled(pool, header, copy, checksum, lossy=False))
            continue
        for buf in taken:  # buffers of an encode that started over (float32 scales)
            if buf is not payload:
                pool.give_back(buf)
        out.append(Recoded(new_header, payload, new_checksum, lossy=True))
    return out


_local = threading.local()
SCRATCH_KEEP = 32 << 20
"""Largest scratch buffer a thread keeps between blocks (larger blocks get a buffer of their own)."""


def _scratch(nbytes: int) -> memoryview:
    """This thread's scratch buffer, ``nbytes`` of it: grown up to :data:`SCRATCH_KEEP`, never
    shrunk, so a pool thread keeps one block's worth instead of allocating and faulting in a new
    one per block."""
    buf = getattr(_local, "scratch", None)
    if buf is None or len(buf) < nbytes:
        buf = bytearray(nbytes)  # a new one: tensors of the old one may still be alive
        if nbytes <= SCRATCH_KEEP:
            _local.scratch = buf
    return memoryview(buf)[:nbytes]


def _pooled(pool: BufferPool, header: bytes, payload: memoryview, checksum: int, *, lossy: bool) -> Recoded | None:
    """``payload`` copied into a buffer of ``pool`` and verified there, in one pass (None: the copy differs)."""
    buf = pool.get(payload.nbytes)
    if copy_checksummed(payload, buf) != checksum:
        pool.give_back(buf)
        return None
    return Recoded(bytes(header), buf, checksum, lossy)


def load_records(disk: DiskTier, keys: list[BlockKey], headers: list[bytes], views: list[memoryview]) -> list[str]:
    """Read records straight into host slots, verify header and payload there.

    Returns, per key: ``"ok"``, ``"missing"`` (the disk no longer holds it) or ``"corrupt"`` (the
    caller frees a slot left so); the caller maps a read error of the batch to ``"error"``.
    """
    out = []
    for header, view, stored in zip(headers, views, disk.read_into(keys, views)):
        if stored is None:
            out.append("missing")
        elif stored != header:
            out.append("corrupt")  # damaged, or not the block the index committed
        else:
            try:
                h, _ = decode_header(header)
                verify_payload(h, view)
            except KVTierError:
                out.append("corrupt")
                continue
            out.append("ok")
    return out


def gpu_to_host(gpu: GpuTier, host: HostTier, gpu_slots: list[Slot], host_slots: list[Slot],
                checksums: list[int]) -> list[str]:
    """Copy GPU slots into host slots, wait for the copies, verify each host copy.

    Returns:
        Per slot: ``"ok"`` or ``"corrupt"`` (the GPU copy fails its checksum).
    """
    for src, dst in zip(gpu_slots, host_slots):
        gpu.copy_out(src, host.torch_view(dst))
    _wait(gpu)
    return ["ok" if payload_checksum(host.view(dst)) == checksum else "corrupt"
            for dst, checksum in zip(host_slots, checksums)]


def gpu_snapshot_verified(gpu: GpuTier, slots: list[Slot], checksums: list[int]) -> list[bytes | None]:
    """Copy GPU slots into host bytes and verify each copy (None for a copy that fails)."""
    out: list[bytes | None] = []
    for slot, checksum in zip(slots, checksums):
        # .cpu() blocks until a device copy is done; on a CPU pool it returns the pool's view,
        # which bytes() then copies.
        data = bytes(gpu.tensor(slot).cpu().numpy())
        out.append(data if payload_checksum(data) == checksum else None)
    return out


def _wait(gpu: GpuTier) -> None:
    """Wait for the asynchronous copies of ``gpu``'s device (a no-op on a CPU pool)."""
    if gpu.device.type == "cuda":
        import torch

        torch.cuda.synchronize(gpu.device)
