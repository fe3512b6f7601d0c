"""BoundedLRU: both bounds hold after every put, the least recently used entry goes first, an entry over the whole
budget is not kept, the counters count, and threads sharing it never see it past its bounds."""

from __future__ import annotations

import threading

import pytest

from vlmrl.cache import BoundedLRU


def sized(max_bytes: int, max_entries: int) -> BoundedLRU[str, bytes]:
    return BoundedLRU(max_bytes, max_entries, lambda key, value: len(value))


def test_bytes_and_entries_bound_and_least_recently_used_goes_first():
    cache = sized(10, 3)
    for key in "abc":
        assert cache.put(key, b"xx")
    assert cache.get("a") == b"xx"  # a is now the most recent; b is the oldest
    assert cache.put("d", b"xx") and "b" not in cache and len(cache) == 3  # the entry bound
    assert cache.put("e", b"xxxxxx")  # 12 bytes over 4 entries: c, the oldest, goes
    assert [k for k in "acde" if k in cache] == ["a", "d", "e"] and cache.bytes == 10
    assert cache.put("f", b"xxxx")  # 14 bytes: a and d go
    assert [k for k in "adef" if k in cache] == ["e", "f"] and cache.bytes == 10
    assert cache.stats() == {"entries": 2, "bytes": 10, "max_bytes": 10, "max_entries": 3, "hits": 1, "misses": 0,
                             "evictions": 4}


def test_an_entry_over_the_budget_is_not_kept_and_evicts_nothing():
    cache = sized(10, 3)
    cache.put("a", b"x")
    assert not cache.put("big", b"x" * 11)
    assert "big" not in cache and cache.get("a") == b"x" and cache.bytes == 1
    cache.put("a", b"yy")  # replacing an entry replaces its size
    assert cache.bytes == 2 and len(cache) == 1
    assert cache.get("missing") is None and cache.misses == 1
    assert cache.pop("a") == b"yy" and cache.bytes == 0
    off = sized(0, 0)
    assert not off.put("a", b"") and len(off) == 0
    with pytest.raises(ValueError, match="max_bytes=-1"):
        sized(-1, 1)


def test_threads_never_see_it_past_its_bounds():
    cache = sized(1000, 50)
    seen: list[int] = []

    def work(seed: int):
        for i in range(2000):
            cache.put(f"{seed}-{i % 97}", b"x" * (i % 60))
            cache.get(f"{seed}-{(i * 7) % 97}")
            seen.append(cache.bytes)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(seen) <= 1000 and len(cache) <= 50
    assert cache.bytes == sum(len(cache.get(k)) for k in list(cache._entries))


def test_a_copy_has_the_entries_and_a_lock_of_its_own():
    """`copy.deepcopy` of a policy copies its processor's caches (the reference, a separate critic)."""
    import copy

    cache = BoundedLRU(100, 10, lambda k, v: len(v))
    cache.put("a", "xyz")
    twin = copy.deepcopy(cache)
    assert twin.get("a") == "xyz" and twin._lock is not cache._lock
    twin.put("b", "12")
    assert cache.get("b") is None and twin.bytes == 5 and cache.bytes == 3
