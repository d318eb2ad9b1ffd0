"""Blocking copy-and-verify steps of the tier moves; the store runs each on its I/O thread pool.

Every function copies first and verifies the copy, so the bytes that land in the destination (or
are handed to the disk) are exactly the bytes that were checked against the header checksum.

torch is imported only by the GPU functions, and only when they run: a store without a GPU tier
never loads it through this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier_protocol.errors import KVTierError
from kvtier_protocol.header import payload_checksum, split_record, verify_payload

from kvtier.store.types import BlockKey, Slot

if TYPE_CHECKING:
    from kvtier.store.disk import DiskTier
    from kvtier.store.gpu import GpuTier
    from kvtier.store.host import HostTier


def snapshot_verified(views: list[memoryview], checksums: list[int]) -> list[bytes | None]:
    """Copy each view and verify the copy: the bytes written down are exactly the bytes checked."""
    out: list[bytes | None] = []
    for view, checksum in zip(views, checksums):
        data = bytes(view)
        out.append(data if payload_checksum(data) == checksum else None)
    return out


def load_records(disk: DiskTier, keys: list[BlockKey], headers: list[bytes], views: list[memoryview]) -> list[str]:
    """Read records, verify header and payload, copy payloads into host slots.

    Returns, per key: ``"ok"``, ``"missing"`` (the disk no longer holds it) or ``"corrupt"``;
    the caller maps a read error of the whole batch to ``"error"``.
    """
    out = []
    for header, view, record in zip(headers, views, disk.get_many(keys)):
        if record is None:
            out.append("missing")
            continue
        try:
            h, payload = split_record(record)
            verify_payload(h, payload)
        except KVTierError:
            out.append("corrupt")
            continue
        if memoryview(record)[:len(header)] != header:
            out.append("corrupt")  # a valid record, but not the block the index committed
            continue
        view[:] = payload
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
