"""Blocking copy-and-verify steps of the tier moves; the store runs each on its I/O thread pool.

Every function copies first and verifies the copy, so the bytes that land in the destination (or
are handed to the disk) are exactly the bytes that were checked against the header checksum.

torch is imported only by the GPU functions, and only when they run: a store without a GPU tier
never loads it through this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier_protocol.errors import KVTierError
from kvtier_protocol.header import decode_header, payload_checksum, verify_payload

from kvtier.daemon.store.disk_io import BufferPool, copy_into
from kvtier.daemon.store.types import BlockKey, Slot

if TYPE_CHECKING:
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
