"""ram_budget: the disk tier's RAM follows the host tier, within fixed bounds."""

from __future__ import annotations

from kvtier.daemon.store.disk_ram import MIB, ram_budget


def test_ram_budget_scales_with_the_host_tier_within_bounds() -> None:
    assert ram_budget(64 * MIB) == (MIB, 8 * MIB, 2 * MIB)
    assert ram_budget(4096 * MIB) == (8 * MIB, 32 * MIB, 32 * MIB)
    assert ram_budget(1 << 50) == (8 * MIB, 512 * MIB, 256 * MIB)
    for host in (1, 64 * MIB, 1 << 34):
        memtable, trim, pool = ram_budget(host)
        assert memtable + pool <= max(host // 16, 3 * MIB), "metadata and buffers stay a small share"
