"""The offline check of a disk tier: ``kvtier check --data-dir D`` with no daemon running.

It opens the tier directly (:class:`~kvtier.daemon.store.disk.DiskTier`), which is what a daemon's
start does: damaged metadata is moved aside and rebuilt from the block files then, and the check
reports that repair. It then lists block files that the metadata does not list and that are not
free (adopted with ``fix``), and reads and verifies every listed record (header and payload
checksum, the file there and whole): the missing and corrupt ones are reported, and removed with
``fix``. A running daemon holds the tier's owner lock: the check is refused then, with the
holder's pid (use the online ``kvtier check``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvtier_protocol.errors import KVTierError, StorageError
from kvtier_protocol.header import split_record, verify_payload

from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.types import make_key

# No budget offline: keep every free file (the daemon's own capacity trims them at its start).
_NO_BUDGET = 1 << 62


@dataclass(slots=True)
class DiskCheck:
    """What the offline check of one disk tier found (and repaired with ``fix``).

    Attributes:
        path: the tier's directory.
        repair: the metadata repair made when it was opened (a sentence), or None.
        records: records the metadata lists (after the repair).
        missing: keys (hex) whose block file is gone.
        corrupt: keys (hex) whose block file fails its header or payload checksum, or is short.
        unlisted: keys (hex) of valid block files the metadata did not list (nor the free list).
        adopted: of ``unlisted``, those listed again (``fix``).
        free_files: files kept free for reuse, and their bytes.
        fixed: whether ``fix`` was asked.
    """

    path: str
    repair: str | None = None
    records: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    free_files: int = 0
    free_bytes: int = 0
    fixed: bool = False

    @property
    def ok(self) -> bool:
        """Nothing wrong was found (a repair made at open counts as found)."""
        return self.repair is None and not (self.missing or self.corrupt or self.unlisted)


def tier_paths(data_dir: str) -> list[str]:
    """The disk tiers under a daemon's data directory: ``<D>/disk``, ``<D>/tenants/*/disk``, or
    ``D`` itself when it is a tier's directory (it holds ``meta`` or ``data``)."""
    if any(os.path.isdir(os.path.join(data_dir, n)) for n in ("meta", "data")):
        return [data_dir]
    found = [os.path.join(data_dir, "disk")]
    tenants = os.path.join(data_dir, "tenants")
    if os.path.isdir(tenants):
        found += [os.path.join(tenants, t, "disk") for t in sorted(os.listdir(tenants))]
    return [p for p in found if os.path.isdir(p)]


def check_tier(path: str, *, fix: bool) -> DiskCheck:
    """Open, check and (with ``fix``) repair the disk tier at ``path``; see the module docstring.

    Raises:
        DirectoryBusy: a daemon has the tier open.
        StorageError: the tier cannot be opened.
    """
    out = DiskCheck(path, fixed=fix)
    with DiskTier(path, _NO_BUDGET, tune_malloc=False, buffer_pool_bytes=8 << 20) as disk:
        if disk.repair is not None:
            out.repair = disk.repair.describe()
        unlisted = disk.unlisted()
        out.unlisted = [f.key.hex() for f in unlisted]
        if fix and unlisted:
            out.adopted = [k.hex() for k in disk.adopt(unlisted)]
        bad: list[bytes] = []
        for key, header in list(disk.iter_meta()):
            out.records += 1
            status = _verify(disk, bytes(key), bytes(header))
            if status != "ok":
                (out.missing if status == "missing" else out.corrupt).append(bytes(key).hex())
                bad.append(bytes(key))
        if fix and bad:
            disk.delete_many(bad)
            out.records -= len(bad)
        out.free_files, out.free_bytes = disk.free_files()
    return out


def _verify(disk: DiskTier, key: bytes, header: bytes) -> str:
    """``"ok"``, ``"missing"`` or ``"corrupt"`` for one listed record (read whole, verified)."""
    try:
        record = disk.get(key)
    except StorageError:
        return "corrupt"  # a short or unreadable file
    if record is None:
        return "missing"
    try:
        h, payload = split_record(record)
        verify_payload(h, payload)
    except KVTierError:
        return "corrupt"
    if record[:len(header)] != header or make_key(h.ns_id, h.chain_hash) != key:
        return "corrupt"
    return "ok"
