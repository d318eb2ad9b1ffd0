"""The GPU tier: device memory pools (one uint8 tensor per segment) carved into slots.

Device-agnostic: ``device="cpu"`` gives the same behaviour in host memory, which is what the tests
use where no GPU exists. Copies are ``Tensor.copy_`` with ``non_blocking=True``, so a copy between
pinned host memory and the device is an asynchronous DMA on the current stream; callers that need
the bytes on the other side synchronise the stream (or record an event) themselves.
"""

from __future__ import annotations

import torch

from kvtier_protocol.errors import InvalidRequest

from kvtier.daemon.store.allocator import SlabAllocator
from kvtier.daemon.store.pooled import SlabBackedTier
from kvtier.daemon.store.types import Slot

GIB = 1 << 30


class GpuTier(SlabBackedTier):
    """Blocks in device memory.

    Args:
        capacity_bytes: bytes of device memory to reserve (allocated up front).
        device: torch device of the pools.
        segment_bytes: size of one pool tensor (clamped to the capacity); the largest block.
        alignment: slot alignment (256 bytes suits any dtype and vectorised kernels).
        slab_bytes: largest slab of the allocator.

    Raises:
        CapacityError: the capacity is below the alignment.
        torch.OutOfMemoryError: the device cannot hold the pools.
    """

    def __init__(self, capacity_bytes: int, *, device: str | torch.device = "cuda", segment_bytes: int = GIB,
                 alignment: int = 256, slab_bytes: int = 64 << 20) -> None:
        self._alloc = SlabAllocator(capacity_bytes, segment_bytes=min(segment_bytes, capacity_bytes),
                                    alignment=alignment, slab_bytes=slab_bytes)
        self.device = torch.device(device)
        self._pools = [torch.empty(size, dtype=torch.uint8, device=self.device) for size in self._alloc.segment_sizes]

    def tensor(self, slot: Slot) -> torch.Tensor:
        """A 1-D uint8 view of the slot's bytes on the device (shares memory)."""
        if not self._pools:
            raise InvalidRequest("the GPU tier is closed")
        seg, off, end = slot.segment, slot.offset, slot.offset + slot.length
        if not (0 <= seg < len(self._pools) and 0 <= off <= end <= self._pools[seg].numel()):
            raise InvalidRequest(f"{slot} is outside the GPU tier")
        return self._pools[seg][off:end]

    def copy_in(self, slot: Slot, src: torch.Tensor) -> None:
        """Copy ``src`` (any dtype and device, contiguous, exactly ``slot.length`` bytes) into the slot."""
        self.tensor(slot).copy_(_as_bytes(src, slot.length), non_blocking=True)

    def copy_out(self, slot: Slot, dst: torch.Tensor) -> None:
        """Copy the slot into ``dst`` (any dtype and device, contiguous, exactly ``slot.length`` bytes)."""
        _as_bytes(dst, slot.length).copy_(self.tensor(slot), non_blocking=True)

    def close(self) -> None:
        """Drop the pools (their memory returns to torch's caching allocator). Idempotent."""
        self._pools = []


def _as_bytes(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``t``'s storage as a flat uint8 tensor, checking it is contiguous and ``nbytes`` long."""
    if not t.is_contiguous():
        raise InvalidRequest("tensors copied to or from the GPU tier must be contiguous")
    if t.numel() * t.element_size() != nbytes:
        raise InvalidRequest(f"tensor of {t.numel() * t.element_size()} bytes does not match a slot of {nbytes}")
    return t.reshape(-1).view(torch.uint8)
