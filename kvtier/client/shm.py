"""The daemon's host segments, mapped into the client from descriptors received at hello.

Over a unix socket the hello response carries one descriptor per segment (SCM_RIGHTS, SPEC.md
§7.4). Slots name byte ranges of these segments; the client writes payloads into reserved slots
(save) and copies payloads out of acquired ones (load), so only metadata crosses the socket::

    segment 0 mapping   [ .... | slot (seg 0, off, len) | .... ]
                                  ^ kvtier.client.memcopy.copy in / out

Every slot the daemon names is bounds-checked against the mapping before it is touched: a wrong
slot is a protocol error (FrameError), never a write outside the segment. Stdlib only (and
kvtier.client.memcopy, whose C part is optional).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier_protocol.errors import FrameError, StorageError
from kvtier_protocol.frames import Segment, SlotRef

import kvtier.client.memcopy as memcopy
from kvtier.client.errors import ConnectionLost

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")

# Pre-fault the page tables at connect: a first write into an unfaulted shared mapping runs at a
# third of the speed of one into a populated mapping (a fault per 4 KiB page), and every save
# would pay that on slots it had not touched before. The daemon's pages already exist (its host
# tier is fallocated), so this maps them rather than allocating; it costs ~80 ms per GiB, paid
# inside connect, so only the first POPULATE_BYTES of segments are populated. Linux only.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
POPULATE_BYTES = 2 << 30


class _Views:
    """Memoryviews taken for one call, released (newest first) when it ends, so that
    :meth:`SegmentMap.close` can always unmap."""

    def __init__(self) -> None:
        self._views: list[memoryview] = []

    def keep(self, view: memoryview) -> memoryview:
        self._views.append(view)
        return view

    def __enter__(self) -> _Views:
        return self

    def __exit__(self, *exc: object) -> None:
        for view in reversed(self._views):
            view.release()
        self._views.clear()


class SegmentMap:
    """Shared host segments mapped read-write into this process.

    Views taken by :meth:`read_record` and :meth:`write` never outlive the call, so :meth:`close`
    can always unmap.
    """

    def __init__(self, segments: Sequence[Segment], maps: Sequence[mmap.mmap]) -> None:
        assert len(segments) == len(maps), "one mapping per segment"
        self._segments = tuple(segments)
        self._maps: list[mmap.mmap] = list(maps)
        self.copy_threads = 1
        """Threads that copy a batch in :meth:`write_many` / :meth:`read_many`
        (``ClientOptions.copy_threads``; kvtier.client.memcopy.copy_many_threads)."""

    @classmethod
    def from_fds(cls, segments: Sequence[Segment], fds: Sequence[int]) -> SegmentMap:
        """Map each descriptor with the size of its segment; the descriptors are always closed.

        Raises:
            FrameError: the number of descriptors differs from the number of segments.
            StorageError: a descriptor is smaller than its segment or cannot be mapped.
        """
        maps: list[mmap.mmap] = []
        try:
            if len(fds) != len(segments):
                raise FrameError(f"hello announced {len(segments)} segments but "
                                 f"{len(fds)} descriptors arrived")
            populated = 0
            for seg, fd in zip(segments, fds):
                populate = _POPULATE if populated + seg.size <= POPULATE_BYTES else 0
                populated += seg.size if populate else 0
                try:
                    if os.fstat(fd).st_size < seg.size:
                        raise StorageError(f"segment {seg.name!r} is smaller than the "
                                           f"{seg.size} bytes announced")
                    maps.append(mmap.mmap(fd, seg.size, flags=mmap.MAP_SHARED | populate,
                                          prot=mmap.PROT_READ | mmap.PROT_WRITE))
                except (OSError, ValueError) as exc:
                    raise StorageError(f"cannot map segment {seg.name!r}: {exc}") from exc
        except BaseException:
            for m in maps:
                m.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)  # each mapping holds its own reference to the memory
        return cls(segments, maps)

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The segments, in the daemon's order (index = segment number of a slot)."""
        return self._segments

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return not self._maps

    def _range(self, slot: SlotRef) -> tuple[mmap.mmap, int, int]:
        if not self._maps:
            # the connection these slots belong to broke (and was unmapped) while a call waited
            raise ConnectionLost("the connection and its segment mappings are closed")
        segment, offset, length = slot
        if not 0 <= segment < len(self._maps) or offset + length > self._segments[segment].size:
            raise FrameError(f"daemon named slot {slot} outside its segments")
        return self._maps[segment], offset, offset + length

    def write(self, slot: SlotRef, data: Buffer) -> None:
        """Copy ``data`` (exactly the slot's length) into ``slot``.

        Raises:
            FrameError: the slot lies outside the segments or its length differs from ``data``.
        """
        self.write_many((slot,), (data,))  # streaming stores: the client never reads the payload back

    def write_many(self, slots: Sequence[SlotRef], payloads: Sequence[Buffer]) -> None:
        """:meth:`write` of ``payloads[i]`` into ``slots[i]`` for every ``i``, the copies made in
        one call (:func:`kvtier.client.memcopy.copy_many_threads`, on :attr:`copy_threads` threads) once
        every slot is checked.

        Raises:
            FrameError: a slot lies outside the segments or its length differs from its payload
                (then nothing is copied).
        """
        with _Views() as views:
            srcs = [views.keep(memoryview(p)) for p in payloads]
            memcopy.copy_many_threads(self._slot_views(slots, [s.nbytes for s in srcs], views), srcs,
                                      self.copy_threads)

    def read_many(self, slots: Sequence[SlotRef], dests: Sequence[memoryview]) -> None:
        """The bytes of ``slots[i]`` into ``dests[i]`` for every ``i``, in one call (as
        :meth:`write_many`).

        Raises:
            FrameError: a slot lies outside the segments or its length differs from its
                destination (then nothing is copied).
        """
        with _Views() as views:
            memcopy.copy_many_threads(dests, self._slot_views(slots, [d.nbytes for d in dests], views),
                                      self.copy_threads)

    def _slot_views(self, slots: Sequence[SlotRef], lengths: Sequence[int], views: _Views) -> list[memoryview]:
        """A view of each slot, checked against the segments and against its expected length."""
        if len(slots) != len(lengths):
            raise FrameError(f"{len(slots)} slots for {len(lengths)} buffers")
        bases: dict[int, memoryview] = {}
        out = []
        for slot, length in zip(slots, lengths):
            mm, start, end = self._range(slot)
            if length != end - start:
                raise FrameError(f"daemon gave a slot of {end - start} bytes for a {length}-byte payload")
            base = bases.get(slot[0])
            if base is None:
                base = bases[slot[0]] = views.keep(memoryview(mm))
            out.append(views.keep(base[start:end]))
        return out

    def read_record(self, header: bytes, slot: SlotRef) -> bytes:
        """A private copy of ``header`` followed by the slot's bytes: one whole block record.

        Raises:
            FrameError: the slot lies outside the segments.
        """
        mm, start, end = self._range(slot)
        with memoryview(mm) as view, view[start:end] as part:
            return b"".join((header, part))  # one copy of the payload, into the result

    def read_into(self, slot: SlotRef, dest: memoryview, copy: Callable[[memoryview, memoryview], T]) -> T:
        """``copy(slot's bytes, dest)`` with the slot's view alive only for the call; its result.

        ``copy`` gets two byte views of equal length (``kvtier.client.load.copy_hashed`` copies
        and hashes in one pass).

        Raises:
            FrameError: the slot lies outside the segments or its length differs from ``dest``.
        """
        with _Views() as views:
            (part,) = self._slot_views((slot,), (dest.nbytes,), views)
            return copy(part, dest)

    def close(self) -> None:
        """Unmap every segment (idempotent)."""
        maps, self._maps = self._maps, []
        for m in maps:
            m.close()
