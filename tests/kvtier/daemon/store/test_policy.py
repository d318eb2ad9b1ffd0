"""PriorityLru eviction order and the disk admission filter."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.daemon.store.policy import AdmissionFilter, PriorityLru


def test_lru_order_is_least_recent_first():
    lru: PriorityLru[str] = PriorityLru(1)
    for k in "abcd":
        lru.push(k, 0)
    lru.touch("a", 0)  # b c d a
    assert list(lru.victims()) == ["b", "c", "d", "a"]
    assert lru.peek() == "b"


def test_lru_lower_class_goes_first_whatever_its_recency():
    lru: PriorityLru[str] = PriorityLru(3)
    lru.push("sys", 2)
    lru.push("old", 0)
    lru.push("mid", 1)
    lru.push("new", 0)
    assert list(lru.victims()) == ["old", "new", "mid", "sys"]


def test_lru_push_existing_moves_to_mru_and_remove_reports_absence():
    lru: PriorityLru[int] = PriorityLru(2)
    lru.push(1, 0)
    lru.push(2, 0)
    lru.push(1, 0)
    assert list(lru.victims()) == [2, 1]
    assert lru.remove(2, 0) is True
    assert lru.remove(2, 0) is False
    assert lru.touch(2, 0) is False
    assert lru.contains(1, 0) and not lru.contains(1, 1)
    assert len(lru) == 1
    lru.remove(1, 0)
    assert lru.peek() is None


_OPS = st.lists(st.tuples(st.sampled_from(["push", "touch", "remove"]), st.integers(0, 7), st.integers(0, 2)),
                max_size=60)


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_lru_matches_a_list_model(ops):
    """Against the obvious model: per class a Python list, MRU appended at the end."""
    lru: PriorityLru[int] = PriorityLru(3)
    model: list[list[int]] = [[], [], []]
    prio: dict[int, int] = {}  # the class an item was pushed with (callers keep it fixed)
    for op, item, p in ops:
        p = prio.setdefault(item, p)
        if op == "push":
            if item in model[p]:
                model[p].remove(item)
            model[p].append(item)
            lru.push(item, p)
        elif op == "touch":
            assert lru.touch(item, p) == (item in model[p])
            if item in model[p]:
                model[p].remove(item)
                model[p].append(item)
        else:
            assert lru.remove(item, p) == (item in model[p])
            if item in model[p]:
                model[p].remove(item)
        assert list(lru.victims()) == model[0] + model[1] + model[2]
        assert lru.peek() == next(iter(model[0] + model[1] + model[2]), None)


def test_admission_threshold_counts_the_commit_as_one_access():
    assert AdmissionFilter(0).admits(1) and AdmissionFilter(1).admits(1)
    two = AdmissionFilter(2)
    assert not two.admits(1)
    assert two.admits(2)


def test_admission_remembers_dropped_blocks_boundedly():
    f: AdmissionFilter[str] = AdmissionFilter(3, ghost_capacity=2)
    f.forget("a", 2)
    f.forget("b", 1)
    f.forget("c", 1)  # "a" is the oldest ghost and goes
    assert len(f) == 2
    assert f.recall("a") == 0
    assert f.recall("b") == 1
    assert f.recall("b") == 0  # recall consumes the entry


def test_admission_keeps_no_ghosts_when_everything_is_admitted():
    f: AdmissionFilter[str] = AdmissionFilter(1)
    f.forget("a", 5)
    assert len(f) == 0
