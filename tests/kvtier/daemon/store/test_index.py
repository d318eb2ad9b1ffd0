"""BlockIndex: prefix lookup, per-tier accounting, LRU membership under leases, moves, priorities."""

from __future__ import annotations

import pytest

from kvtier.daemon.store.index import BlockIndex, BlockMeta, BlockState
from kvtier.daemon.store.types import Slot, Tier, make_key

NS = b"n" * 16
NS2 = b"m" * 16


def key(i: int, ns: bytes = NS):
    return make_key(ns, i.to_bytes(32, "big"))


def committed(index: BlockIndex, i: int, size: int = 100, *, tier: Tier = Tier.HOST, ns: bytes = NS,
              header: bytes = b"h" * 20, now: float = 0.0) -> BlockMeta:
    meta = BlockMeta(key(i, ns), size)
    index.add(meta)
    index.commit(meta, header, None, 16, 0, now)
    index.place(meta, tier, Slot(0, i * 1000, size) if tier is not Tier.DISK else None)
    return meta


@pytest.fixture
def index() -> BlockIndex:
    return BlockIndex({Tier.HOST: 1000, Tier.DISK: 5000}, num_classes=3)


def test_lookup_returns_the_consecutive_prefix_only(index):
    for i in (0, 1, 3):
        committed(index, i)
    assert [m.key for m in index.lookup([key(0), key(1), key(2), key(3)])] == [key(0), key(1)]
    assert index.lookup([key(2), key(0)]) == []
    assert index.lookup([]) == []


def test_lookup_skips_pending_blocks_and_other_namespaces(index):
    committed(index, 0)
    pending = BlockMeta(key(1), 50)
    index.add(pending)
    index.place(pending, Tier.HOST, Slot(0, 0, 50))
    committed(index, 2, ns=NS2)
    assert len(index.lookup([key(0), key(1)])) == 1
    assert index.lookup([key(2)]) == []
    assert index.visible(key(1)) is None and index.get(key(1)) is pending
    assert index.pending == 1


def test_lookup_names_names_the_fastest_tier_of_each_hit(index):
    committed(index, 0, tier=Tier.DISK)
    both = committed(index, 1)
    index.place(both, Tier.DISK)
    committed(index, 2)
    pending = BlockMeta(key(3), 50)
    index.add(pending)
    keys = [key(i) for i in range(4)]
    assert index.lookup_names(keys) == ["disk", "host", "host"]
    assert index.lookup_names(keys) == [m.fastest_tier.wire_name for m in index.lookup(keys)]
    assert index.lookup_names([key(9), key(0)]) == [] and index.lookup_names([]) == []
    assert [t.wire_name for t in Tier] == ["gpu", "host", "disk", "remote"]


def test_accounting_charges_payload_in_memory_and_record_on_disk(index):
    meta = committed(index, 0, size=100, header=b"h" * 24)
    index.place(meta, Tier.DISK)
    assert index.used[Tier.HOST] == 100 and index.used[Tier.DISK] == 124
    assert meta.tiers == [Tier.HOST, Tier.DISK]
    slot = index.unplace(meta, Tier.HOST)
    assert slot == Slot(0, 0, 100)
    assert index.used[Tier.HOST] == 0 and index.count[Tier.HOST] == 0
    assert index.accounting_errors() == []


def test_has_room_is_byte_exact(index):
    committed(index, 0, size=600)
    assert index.has_room(Tier.HOST, 400)
    assert not index.has_room(Tier.HOST, 401)
    assert index.free_bytes(Tier.HOST) == 400


def test_place_beyond_capacity_is_an_invariant_violation(index):
    committed(index, 0, size=900)
    meta = BlockMeta(key(1), 200)
    index.add(meta)
    with pytest.raises(AssertionError):
        index.place(meta, Tier.HOST, Slot(0, 0, 200))


def test_victims_are_lru_within_lowest_priority_class(index):
    a, b, c = (committed(index, i) for i in range(3))
    index.touch(a, now=5.0)  # order: b c a
    assert list(index.victims(Tier.HOST)) == [b, c, a]
    index.set_priority(b, 2)  # b now last
    assert list(index.victims(Tier.HOST)) == [c, a, b]
    assert a.last_access == 5.0


def test_lease_removes_memory_copy_from_victims_but_not_disk_copy(index):
    a = committed(index, 0)
    index.place(a, Tier.DISK)
    b = committed(index, 1)
    index.lease(a)
    assert list(index.victims(Tier.HOST)) == [b]
    assert list(index.victims(Tier.DISK)) == [a]
    index.unlease(a)  # back, as most recently used
    assert list(index.victims(Tier.HOST)) == [b, a]


def test_touch_moves_a_block_only_in_the_queues_that_hold_it(index):
    a, b = committed(index, 0), committed(index, 1)
    index.place(a, Tier.DISK)
    index.place(b, Tier.DISK)
    index.lease_all([a])  # out of the host queue, still in the disk queue
    index.touch(a, now=7.0)
    assert list(index.victims(Tier.DISK)) == [b, a] and a.last_access == 7.0
    assert list(index.victims(Tier.HOST)) == [b]
    index.unlease(a)  # back in host, as most recently used
    assert list(index.victims(Tier.HOST)) == [b, a]
    assert index.accounting_errors() == []


def test_lease_all_is_lease_of_each(index):
    a, b, c = (committed(index, i) for i in range(3))
    index.lease_all([a, c])
    assert (a.leases, b.leases, c.leases) == (1, 0, 1)
    assert list(index.victims(Tier.HOST)) == [b]
    assert index.accounting_errors() == []


def test_moving_and_pending_blocks_are_never_victims(index):
    a = committed(index, 0)
    index.set_moving(a, True)
    pending = BlockMeta(key(1), 10)
    index.add(pending)
    index.place(pending, Tier.HOST, Slot(0, 0, 10))
    assert list(index.victims(Tier.HOST)) == []
    index.set_moving(a, False)
    assert list(index.victims(Tier.HOST)) == [a]


def test_unlinked_leased_block_keeps_its_charge_and_frees_the_key(index):
    old = committed(index, 0, size=300)
    index.lease(old)
    index.unlink(old)
    assert index.get(key(0)) is None and not old.linked
    assert index.used[Tier.HOST] == 300
    new = committed(index, 0, size=200)  # the key is free for a new block at once
    assert index.used[Tier.HOST] == 500
    index.unlease(old)
    index.unplace(old, Tier.HOST)
    assert index.used[Tier.HOST] == 200
    assert list(index.victims(Tier.HOST)) == [new]  # the old block's exit did not dequeue the new one
    assert index.accounting_errors() == []


def test_namespace_lists_only_its_blocks(index):
    committed(index, 0)
    committed(index, 1, ns=NS2)
    assert [m.key for m in index.namespace(NS)] == [key(0)]
    index.unlink(index.get(key(0)))
    assert index.namespace(NS) == []


def test_accounting_errors_reports_a_corrupted_counter(index):
    committed(index, 0)
    index.used[Tier.HOST] += 1
    assert any("HOST" in e for e in index.accounting_errors())


def test_commit_sets_state_and_summary(index):
    meta = BlockMeta(key(7), 10)
    index.add(meta)
    index.commit(meta, b"hdr", b"p" * 32, 16, 99, now=3.0)
    assert meta.state is BlockState.COMMITTED and meta.parent_hash == b"p" * 32
    assert meta.ns_id == NS and meta.chain_hash == (7).to_bytes(32, "big")
    assert meta.accesses == 1


def test_lru_membership_follows_every_state_change_and_the_audit_checks_it(index):
    """The record of which queues hold a block (what _refresh compares against) stays true through
    every change that moves it in or out of a queue; a stale record is an accounting error."""
    a = committed(index, 0)
    index.place(a, Tier.DISK)
    b = BlockMeta(key(1), 100)
    index.add(b)
    index.place(b, Tier.HOST, Slot(0, 5000, 100))
    index.lease(b)
    steps = [lambda: index.lease(a), lambda: index.unlease(a), lambda: index.set_moving(a, True),
             lambda: index.set_moving(a, False), lambda: index.set_priority(a, 2),
             lambda: index.commit(b, b"h", None, 16, 0, 1.0), lambda: index.unlease(b),
             lambda: index.unplace(a, Tier.HOST), lambda: index.set_priority(a, 0),
             lambda: index.unlink(b)]
    for step in steps:
        step()
        assert index.accounting_errors([m for m in (a, b) if not m.linked]) == []  # unlinked: charged still
        for meta in (a, b):
            for tier in (Tier.HOST, Tier.DISK):
                assert (meta in list(index.victims(tier))) == index.evictable(meta, tier)
    assert list(index.victims(Tier.DISK)) == [a] and list(index.victims(Tier.HOST)) == []
    a.queued ^= 0b100  # the record no longer says the disk queue holds it
    assert any("LRU queues" in e for e in index.accounting_errors())


def _fields(meta: BlockMeta) -> dict:
    return {f: getattr(meta, f) for f in BlockMeta.__slots__}


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.GPU])
@pytest.mark.parametrize("checked", [False, True])
def test_the_fused_reserve_and_commit_steps_equal_the_separate_ones(tier, checked):
    """add_reserved = add + place + lease, commit_reserved = commit + mark checked + unlease: the
    same block, the same charges, the same LRU membership and audit."""
    caps = {Tier.HOST: 1000, Tier.GPU: 1000, Tier.DISK: 5000}
    fused, apart = BlockIndex(caps, num_classes=3), BlockIndex(caps, num_classes=3)
    slot = Slot(0, 0, 100)
    a = fused.add_reserved(key(1), 100, tier, slot, 2, 5)
    b = BlockMeta(key(1), 100, priority=2, prior_accesses=5)
    apart.add(b)
    apart.place(b, tier, slot)
    apart.lease(b)
    assert _fields(a) == _fields(b)
    assert (fused.used, fused.count, fused.pending) == (apart.used, apart.count, apart.pending)
    assert fused.namespace(NS) == [a] and list(fused.victims(tier)) == []  # pending: never a victim
    fused.commit_reserved(a, b"h" * 20, None, 16, 7, 3.0, checked=checked)
    apart.commit(b, b"h" * 20, None, 16, 7, 3.0)
    if checked and tier is Tier.HOST:
        apart.mark_host_checked(b)
    apart.unlease(b)
    assert _fields(a) == _fields(b)
    assert (fused.used, fused.count, fused.pending) == (apart.used, apart.count, apart.pending)
    assert list(fused.victims(tier)) == [a] and fused.accounting_errors() == []
    assert a.host_checked is (checked and tier is Tier.HOST)


def test_a_fused_reserve_beyond_capacity_or_of_a_known_key_is_an_invariant_violation(index):
    index.add_reserved(key(1), 600, Tier.HOST, Slot(0, 0, 600), 0, 0)
    with pytest.raises(AssertionError, match="already indexed"):
        index.add_reserved(key(1), 10, Tier.HOST, Slot(0, 600, 10), 0, 0)
    with pytest.raises(AssertionError, match="capacity"):
        index.add_reserved(key(2), 600, Tier.HOST, Slot(0, 600, 600), 0, 0)


def test_lease_all_and_unlease_all_keep_the_queues_as_lease_and_unlease_one_by_one(index):
    # Their fast paths (a host-only block leaves and re-enters the host queue directly) against
    # the general refresh: blocks on disk too, in GPU too, leased twice, a pending one.
    host_only = [committed(index, i) for i in range(3)]
    on_disk = committed(index, 3)
    index.place(on_disk, Tier.DISK)
    both = BlockIndex({Tier.GPU: 1000, Tier.HOST: 1000, Tier.DISK: 5000}, num_classes=3)
    in_gpu = committed(both, 4)
    both.place(in_gpu, Tier.GPU, Slot(1, 0, 100))
    metas = [*host_only, on_disk]
    index.lease_all(metas)
    index.lease_all(host_only[:1])  # leased twice
    both.lease_all([in_gpu])
    assert index.accounting_errors() == [] and both.accounting_errors() == []
    assert list(index.victims(Tier.HOST)) == [] and list(index.victims(Tier.DISK)) == [on_disk]
    assert list(both.victims(Tier.GPU)) == [] and list(both.victims(Tier.HOST)) == []
    index.unlease_all(reversed(metas))  # released in another order: re-queued most recent last
    assert index.accounting_errors() == []
    assert list(index.victims(Tier.HOST)) == [on_disk, host_only[2], host_only[1]]  # host_only[0]: still leased
    index.unlease_all(host_only[:1])
    both.unlease_all([in_gpu])
    assert list(index.victims(Tier.HOST)) == [on_disk, host_only[2], host_only[1], host_only[0]]
    assert index.accounting_errors() == [] and both.accounting_errors() == []
    assert list(both.victims(Tier.GPU)) == [in_gpu] and list(both.victims(Tier.HOST)) == [in_gpu]


def test_place_many_renames_and_commits_pending_blocks_as_rename_then_commit_reserved(index):
    grant_ns = b"g" * 16
    pending = [index.add_reserved(key(i, grant_ns), 100, Tier.HOST, Slot(0, i * 100, 100), 1, 0) for i in range(3)]
    other = index.add_reserved(key(9, grant_ns), 100, Tier.HOST, Slot(0, 900, 100), 0, 0)
    keys = [key(i) for i in range(3)]
    recalled = {keys[1]: 5}

    class H:  # the parsed header fields a commit keeps
        def __init__(self, i):
            self.parent_hash, self.num_tokens, self.checksum = (None if i == 0 else b"p" * 32), 16, 1000 + i

    index.place_many(pending, keys, lambda k: recalled.get(k, 0), [b"h%d" % i for i in range(3)],
                     [H(i) for i in range(3)], 7.0, checked=True)
    assert index.accounting_errors() == [] and index.pending == 1
    assert [m.key for m in index.lookup(keys)] == keys and index.get(key(0, grant_ns)) is None
    assert [m.key for m in index.namespace(grant_ns)] == [other.key]
    assert [(m.header, m.checksum, m.prior_accesses, m.leases, m.host_checked, m.last_access) for m in pending] == [
        (b"h0", 1000, 0, 0, True, 7.0), (b"h1", 1001, 5, 0, True, 7.0), (b"h2", 1002, 0, 0, True, 7.0)]
    assert list(index.victims(Tier.HOST)) == pending  # committed, unleased: queued in order
    assert index.known([keys[0], key(9, grant_ns), key(5)]) == {keys[0], key(9, grant_ns)}


def test_a_geometry_remembered_for_one_namespace_is_still_checked_against_another():
    # validation.check_geometry remembers geometries that passed (one probe per block after the
    # first); the memo is per namespace object, so a namespace that disagrees still refuses them.
    from kvtier_protocol.errors import NamespaceError
    from kvtier_protocol.header import BlockHeader, Section
    from kvtier_protocol.namespace import Namespace

    from kvtier.daemon.store.validation import check_geometry

    fields = dict(model="m", revision="r", attention="mha", num_kv_heads=1, head_dim=64, kv_dtype="float16",
                  block_tokens=16, hash_tokens=16)
    one, two = Namespace(num_layers=1, **fields), Namespace(num_layers=2, **fields)
    h = BlockHeader(ns_id=one.ns_id, chain_hash=b"c" * 32, parent_hash=None, num_tokens=16, layout="canonical",
                    shape=(1, 2, 1, 16, 64), dtype="float16", codec="raw", sections=(Section("payload", 0, 4096),),
                    payload_len=4096, checksum=0)
    for _ in range(2):  # the second time from the memo
        check_geometry(h, one)
        with pytest.raises(NamespaceError):
            check_geometry(h, two)
    with pytest.raises(NamespaceError):  # bfloat16: another geometry, checked in full
        check_geometry(BlockHeader(**{**{f: getattr(h, f) for f in h.__slots__}, "dtype": "bfloat16"}), one)


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.GPU])
def test_add_reserved_many_is_add_reserved_of_each(tier):
    """The grant's batch step: the same blocks, charges, pending count and namespace sets as
    add_reserved one key at a time (placeholder keys of one namespace, and keys of two)."""
    caps = {Tier.HOST: 1000, Tier.GPU: 1000, Tier.DISK: 5000}
    batch, single = BlockIndex(caps, num_classes=3), BlockIndex(caps, num_classes=3)
    keys = [key(1), key(2), key(3, NS2), key(4)]
    slots = [Slot(0, i * 100, 100) for i in range(4)]
    got = batch.add_reserved_many(keys, 100, tier, slots, 2)
    want = [single.add_reserved(k, 100, tier, s, 2, 0) for k, s in zip(keys, slots)]
    assert [_fields(m) for m in got] == [_fields(m) for m in want]
    assert (batch.used, batch.count, batch.pending) == (single.used, single.count, single.pending)
    for ns in (NS, NS2):
        assert {m.key for m in batch.namespace(ns)} == {m.key for m in single.namespace(ns)}
    assert batch.accounting_errors() == [] and list(batch.victims(tier)) == []
    assert batch.add_reserved_many([key(9)], 100, tier, [], 0) == []  # no slot, no block
    (ghost,) = batch.add_reserved_many([key(5)], 100, tier, [Slot(0, 500, 100)], 1, [4])  # a reserve's recall
    assert _fields(ghost) == _fields(single.add_reserved(key(5), 100, tier, Slot(0, 500, 100), 1, 4))
    with pytest.raises(AssertionError, match="capacity"):
        batch.add_reserved_many([key(7), key(8)], 400, tier, [Slot(0, 400, 400), Slot(0, 800, 400)], 0)
    with pytest.raises(AssertionError, match="already indexed"):
        batch.add_reserved_many([key(1)], 10, tier, [Slot(0, 900, 10)], 0)


@pytest.mark.parametrize("checked", [False, True])
def test_commit_reserved_many_is_commit_reserved_of_each(checked):
    """The trusted commit's batch step: the same blocks, pending count, LRU membership and audit
    as commit_reserved one block at a time (a host block and a GPU block)."""
    caps = {Tier.HOST: 1000, Tier.GPU: 1000, Tier.DISK: 5000}
    batch, single = BlockIndex(caps, num_classes=3), BlockIndex(caps, num_classes=3)
    tiers = [Tier.HOST, Tier.GPU, Tier.HOST]

    class Summary:  # what a decoded header contributes to a commit
        def __init__(self, i: int) -> None:
            self.parent_hash, self.num_tokens, self.checksum = (key(i - 1)[16:] if i else None), 16, 100 + i

    metas = [idx.add_reserved(key(i), 100, t, Slot(0, i * 100, 100), 1, 0)
             for idx in (batch, single) for i, t in enumerate(tiers)]
    headers = [bytearray(b"h%d" % i * 10) for i in range(3)]
    batch.commit_reserved_many(metas[:3], headers, [Summary(i) for i in range(3)], 2.0, checked)
    for i, meta in enumerate(metas[3:]):
        h = Summary(i)
        single.commit_reserved(meta, bytes(headers[i]), h.parent_hash, h.num_tokens, h.checksum, 2.0, checked=checked)
    assert [_fields(m) for m in metas[:3]] == [_fields(m) for m in metas[3:]]
    assert all(type(m.header) is bytes for m in metas[:3])  # a copy, never the caller's buffer
    assert (batch.used, batch.count, batch.pending) == (single.used, single.count, single.pending)
    for tier in (Tier.HOST, Tier.GPU):
        assert [m.key for m in batch.victims(tier)] == [m.key for m in single.victims(tier)]
    assert batch.accounting_errors() == []
    with pytest.raises(AssertionError, match="leased"):
        batch.commit_reserved_many(metas[:1], headers[:1], [Summary(0)], 3.0, checked)
