"""What lets a restarted daemon adopt the host tier a crashed one left: the segment directory and
the slot journal. Stdlib + xxhash only.

The host tier's segments live in /dev/shm and outlive the daemon process; only a reboot (or an
unlink) empties them. A slot holds a block's *payload* only (the header goes over the socket at
commit and is kept in the daemon's index), and the slab allocator's layout (which offsets hold
slots of which size) is daemon memory too, so neither "which slots hold blocks" nor "what is in
them" can be read back from the segments alone: scanning them for records would be ambiguous
(freed slots keep their old bytes, slabs are re-carved in other sizes) and could bring back blocks
that were deleted. So the daemon persists exactly what it needs, cheaply:

* the **segment directory**: ``<dir>/host-segments.json`` in the directory whose owner lock the
  store holds (the disk tier's, see :mod:`kvtier.daemon.store.owner`): the segments' names and
  sizes, the name prefix (the tenant's, for a tenant's store), the allocator alignment and the
  journal's name. Written atomically (a temp file renamed over it) when the segments are made or
  adopted, removed at a clean close. Records no data, so it is never a durability concern.
* the **slot journal**: a file in /dev/shm beside the segments (``<segment 0's name>.journal``,
  same lifetime), appended to in the daemon's memory order: ``COMMIT(slot, priority, header)``
  when a host copy becomes visible (commit, demotion from GPU, promotion from disk), ``FREE(slot)``
  when a journaled slot is freed or its block deleted. Each entry carries its own xxh3-64, so a
  daemon killed inside a write leaves at most one torn entry, at the end, which replay drops.
  Appends are buffered and written (one ``write`` to tmpfs: no disk I/O, no fsync; a page-cache
  write survives the process) before a commit is acknowledged and before a delete returns; a FREE
  written late can only bring back a block that was evicted, whose copy still verifies.
  When the journal grows past twice what its live entries need (and 1 MiB), it is rewritten
  from the live entries into a temp file renamed over it (atomic: a crash leaves old or new).

Replay (:func:`replay`) yields the live ``slot -> (priority, header)`` map; the store then checks
every entry against the segment (header decodes and names the slot's length, payload matches the
header's checksum) before it adopts it (:mod:`kvtier.daemon.store.host_recovery`).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from kvtier.daemon.store import shm
from kvtier.daemon.store.owner import FILE_MODE
from kvtier.daemon.store.types import Slot

DIRECTORY_NAME = "host-segments.json"
JOURNAL_SUFFIX = ".journal"
DIRECTORY_VERSION = 1
FILE_MAGIC = b"KVTJ\x01\x00\x00\x00"  # journal file: magic, version 1, reserved
ENTRY = struct.Struct("<4sBBHQQI")  # magic, kind, priority, segment, offset, length, header_len
ENTRY_MAGIC = b"KVJE"
DIGEST = struct.Struct("<Q")  # xxh3-64 of the entry's fixed part and header
COMMIT, FREE = 1, 2
COMPACT_MIN_BYTES = 1 << 20
FLUSH_BYTES = 256 << 10  # pending appends written at once beyond this, whatever the caller does
_ENTRY_OVERHEAD = ENTRY.size + DIGEST.size  # bytes of an entry besides its header
_FREE_ENTRY_BYTES = _ENTRY_OVERHEAD  # a FREE entry carries no header


@dataclass(frozen=True, slots=True)
class SegmentDirectory:
    """The segment directory file's content (see the module docstring)."""

    prefix: str  # segment name prefix (the tenant's for a tenant's store)
    pid: int  # the daemon that wrote it
    alignment: int  # the allocator's slot alignment
    names: tuple[str, ...]  # segment names under /dev/shm, in Slot.segment order
    sizes: tuple[int, ...]  # their sizes in bytes
    journal: str  # the slot journal's name under /dev/shm
    was: tuple[str, ...] = ()  # names the segments had before an adoption renamed them

    def write(self, directory: str) -> None:
        """Replace ``<directory>/host-segments.json`` atomically (mode 0600)."""
        path = os.path.join(directory, DIRECTORY_NAME)
        tmp = f"{path}.{os.getpid()}.tmp"
        doc = {"version": DIRECTORY_VERSION, "prefix": self.prefix, "pid": self.pid, "alignment": self.alignment,
               "segments": [{"name": n, "size": s, **({"was": w} if w else {})}
                            for n, s, w in zip(self.names, self.sizes, self.was or ("",) * len(self.names))],
               "journal": self.journal}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.write(fd, json.dumps(doc).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)

    @classmethod
    def read(cls, directory: str) -> SegmentDirectory | None:
        """The directory file of ``directory``; None when missing or unreadable (nothing to adopt)."""
        try:
            with open(os.path.join(directory, DIRECTORY_NAME), "rb") as f:
                doc = json.loads(f.read(1 << 20))
            segs = doc["segments"]
            out = cls(str(doc["prefix"]), int(doc["pid"]), int(doc["alignment"]),
                      tuple(shm.check_name(s["name"]) for s in segs), tuple(int(s["size"]) for s in segs),
                      shm.check_name(doc["journal"]), tuple(str(s.get("was", "")) for s in segs))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # noqa: F841 - any damage: nothing to adopt
            return None
        if doc.get("version") != DIRECTORY_VERSION or not out.names:
            return None
        return out

    @staticmethod
    def remove(directory: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, DIRECTORY_NAME))


def _entry(kind: int, slot: Slot, priority: int, header: bytes) -> bytes:
    segment, offset, length = slot
    body = _pack_entry(ENTRY_MAGIC, kind, priority, segment, offset, length, len(header)) + header
    return body + _pack_digest(_digest(body))


_pack_entry, _pack_digest, _digest = ENTRY.pack, DIGEST.pack, xxhash.xxh3_64_intdigest  # _entry runs per block


@dataclass(frozen=True, slots=True)
class Replayed:
    """What :func:`replay` found: the live entries and whether the file ended in a torn entry."""

    live: dict[tuple[int, int], tuple[Slot, int, bytes]]  # (segment, offset) -> (slot, priority, header)
    torn: int  # 1 when the journal ended inside an entry (or in bytes that are no entry)


def replay(data: bytes) -> Replayed:
    """The live slots a journal's bytes describe, in order: COMMIT adds, FREE removes."""
    live: dict[tuple[int, int], tuple[Slot, int, bytes]] = {}
    if not data.startswith(FILE_MAGIC):
        return Replayed(live, 1 if data else 0)
    pos, end, view = len(FILE_MAGIC), len(data), memoryview(data)
    while pos < end:
        if end - pos < ENTRY.size + DIGEST.size:
            return Replayed(live, 1)
        magic, kind, priority, seg, off, length, hlen = ENTRY.unpack_from(view, pos)
        stop = pos + ENTRY.size + hlen
        if magic != ENTRY_MAGIC or kind not in (COMMIT, FREE) or stop + DIGEST.size > end:
            return Replayed(live, 1)
        if DIGEST.unpack_from(view, stop)[0] != xxhash.xxh3_64_intdigest(view[pos:stop]):
            return Replayed(live, 1)
        if kind == COMMIT:
            live[(seg, off)] = (Slot(seg, off, length), priority, bytes(view[pos + ENTRY.size:stop]))
        else:
            live.pop((seg, off), None)
        pos = stop + DIGEST.size
    return Replayed(live, 0)


class SlotJournal:
    """The host tier's slot journal (see the module docstring): appends, flushes, compaction.

    Args:
        name: the journal's file name under /dev/shm.
        live: entries already in the file (an adopted journal's replay), kept as the live set.

    Raises:
        OSError: the file cannot be opened or written.
    """

    def __init__(self, name: str, live: dict[tuple[int, int], tuple[Slot, int, bytes]] | None = None) -> None:
        self.name = shm.check_name(name)
        self._path = shm.segment_path(name)
        # (segment, offset) -> (slot, priority, header): what a compaction writes out. The header
        # is the index's own bytes object (not a copy).
        self._live: dict[tuple[int, int], tuple[Slot, int, bytes]] = {}
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._live_bytes = 0
        self._fd = -1
        self._size = 0
        self._rewrite(live or {})

    @property
    def live(self) -> int:
        """Journaled slots (committed host copies)."""
        return len(self._live)

    def __contains__(self, slot: Slot) -> bool:
        return (slot.segment, slot.offset) in self._live

    def commit(self, slot: Slot, priority: int, header: bytes) -> None:
        """Note a host copy that became visible (written at the next :meth:`flush`)."""
        key = (slot[0], slot[1])  # (segment, offset)
        live = self._live
        old = live.get(key)
        if old is not None:
            self._live_bytes -= len(old[2]) + _ENTRY_OVERHEAD
        live[key] = (slot, priority, header)
        self._live_bytes += len(header) + _ENTRY_OVERHEAD
        entry = _entry(COMMIT, slot, priority, header)
        self._pending.append(entry)  # _append, inline: this runs per block committed
        self._pending_bytes += len(entry)
        if self._pending_bytes >= FLUSH_BYTES:
            self.flush()

    def commit_many(self, items: Iterable[tuple[Slot, int, bytes]]) -> None:
        """:meth:`commit` of each ``(slot, priority, header)``, in order (the same entries), in
        one pass: a batch made visible. Pending entries are written past :data:`FLUSH_BYTES`
        once, at the end of the batch, not within it."""
        live, pending = self._live, self._pending
        live_bytes = pending_bytes = 0
        for slot, priority, header in items:
            seg, off, length = slot
            key = (seg, off)
            old = live.get(key)
            if old is not None:
                live_bytes -= len(old[2]) + _ENTRY_OVERHEAD
            live[key] = (slot, priority, header)
            live_bytes += len(header) + _ENTRY_OVERHEAD
            body = _pack_entry(ENTRY_MAGIC, COMMIT, priority, seg, off, length, len(header)) + header
            entry = body + _pack_digest(_digest(body))  # _entry(COMMIT, slot, priority, header), inline
            pending.append(entry)
            pending_bytes += len(entry)
        self._live_bytes += live_bytes
        self._pending_bytes += pending_bytes
        if self._pending_bytes >= FLUSH_BYTES:
            self.flush()

    def free(self, slot: Slot) -> None:
        """Note a journaled slot freed or its block deleted; a slot never journaled is ignored."""
        old = self._live.pop((slot.segment, slot.offset), None)
        if old is None:
            return
        self._live_bytes -= len(old[2]) + ENTRY.size + DIGEST.size
        self._append(_entry(FREE, slot, 0, b""))

    def free_many(self, slots: Sequence[Slot]) -> None:
        """:meth:`free` each of ``slots``, in order (the same entries), in one pass: a delete's
        or an eviction's batch. Pending entries are written past :data:`FLUSH_BYTES` once, at
        the end of the batch, not within it."""
        pop, pending = self._live.pop, self._pending
        freed = added = 0
        for slot in slots:
            seg, off, length = slot
            old = pop((seg, off), None)
            if old is None:
                continue
            freed += len(old[2])
            body = _pack_entry(ENTRY_MAGIC, FREE, 0, seg, off, length, 0)
            entry = body + _pack_digest(_digest(body))  # _entry(FREE, slot, 0, b""), inline
            pending.append(entry)
            added += 1
        if not added:
            return
        self._live_bytes -= freed + added * _ENTRY_OVERHEAD
        self._pending_bytes += added * _FREE_ENTRY_BYTES
        if self._pending_bytes >= FLUSH_BYTES:
            self.flush()

    def _append(self, entry: bytes) -> None:
        self._pending.append(entry)
        self._pending_bytes += len(entry)
        if self._pending_bytes >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write the pending entries (one write), or rewrite the journal when it outgrew its live set.

        Raises:
            OSError: /dev/shm refused the write (full): the caller logs it; recovery after a crash
                then adopts fewer blocks, never wrong ones (every entry is verified on replay).
        """
        if not self._pending:
            return
        if self._size + self._pending_bytes > max(COMPACT_MIN_BYTES, 2 * self._live_bytes):
            self._rewrite(self._live)
            return
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        written = os.pwrite(self._fd, data, self._size)
        assert written == len(data), "tmpfs writes are whole"
        self._size += written

    def _rewrite(self, live: dict[tuple[int, int], tuple[Slot, int, bytes]]) -> None:
        """Write ``live`` into a fresh file and rename it over the journal (atomic)."""
        tmp = self.name + ".tmp"
        fd = shm.create_file(tmp)
        try:
            data = FILE_MAGIC + b"".join(_entry(COMMIT, s, p, h) for s, p, h in live.values())
            os.pwrite(fd, data, 0)
            os.rename(shm.segment_path(tmp), self._path)
        except BaseException:
            os.close(fd)
            shm.unlink_segment(tmp)
            raise
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._size = fd, len(data)
        if live is not self._live:
            self._live = dict(live)
        self._live_bytes = sum(len(h) + ENTRY.size + DIGEST.size for _, _, h in self._live.values())
        self._pending.clear()
        self._pending_bytes = 0

    def close(self, *, remove: bool) -> None:
        """Close the file; ``remove``: unlink it too (a clean close: nothing to adopt)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                if not remove:
                    self.flush()
            os.close(self._fd)
            self._fd = -1
        if remove:
            shm.unlink_segment(self.name)


def read_journal(name: str) -> bytes | None:
    """A journal's bytes, or None when it does not exist."""
    try:
        with open(shm.segment_path(name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
