"""GpuTier: slots in device pools; run on CPU here, on CUDA where a device exists."""

from __future__ import annotations

import pytest
import torch

from kvtier_protocol.errors import CapacityError, InvalidRequest

from kvtier.daemon.store.gpu import GpuTier
from kvtier.daemon.store.types import Slot

MIB = 1 << 20


def _round_trip(device: str) -> None:
    tier = GpuTier(8 * MIB, device=device, segment_bytes=4 * MIB)
    assert tier.capacity == 8 * MIB and tier.device.type == torch.device(device).type
    kv = torch.randn(2, 4, 16, 64, dtype=torch.bfloat16)  # 16 KiB of "KV"
    slot = tier.allocate(kv.numel() * kv.element_size())
    other = tier.allocate(1000)
    assert slot is not None and other is not None and slot.offset % 256 == 0
    tier.copy_in(slot, kv)
    tier.copy_in(other, torch.full((1000,), 3, dtype=torch.uint8))
    out = torch.empty_like(kv)
    tier.copy_out(slot, out)
    if tier.device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, kv)
    assert tier.tensor(other).device.type == tier.device.type
    assert bool((tier.tensor(other).cpu() == 3).all())
    tier.free(slot)
    tier.free(other)
    assert tier.allocated_bytes == 0
    tier.allocator.check()
    tier.close()


def test_round_trip_on_cpu() -> None:
    _round_trip("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_round_trip_on_cuda() -> None:
    _round_trip("cuda")


def test_views_share_the_pool_and_errors() -> None:
    tier = GpuTier(4 * MIB, device="cpu")
    slot = tier.allocate(4096)
    assert slot is not None
    tier.tensor(slot).fill_(9)
    assert bool((tier.tensor(slot) == 9).all())
    with pytest.raises(InvalidRequest):
        tier.copy_in(slot, torch.zeros(4095, dtype=torch.uint8))  # wrong size
    with pytest.raises(InvalidRequest):
        tier.copy_in(slot, torch.zeros(64, 128, dtype=torch.uint8).t())  # not contiguous
    with pytest.raises(InvalidRequest):
        tier.tensor(Slot(1, 0, 10))
    with pytest.raises(CapacityError):
        tier.allocate(4 * MIB + 1)
    assert tier.allocate(4 * MIB) is None  # room taken by the first slot's slab
    tier.close()
    with pytest.raises(InvalidRequest):
        tier.tensor(slot)
