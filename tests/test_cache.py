"""BoundedLRU: both bounds hold after every put, the least recently used entry goes first, an entry over the whole
budget is not kept, the counters count, and threads sharing it never see it past its bounds."""

from __future__ import annotations

import contextlib
import sys
import threading

import pytest

from vlmrl.cache import BoundedLRU


@contextlib.contextmanager
def switching_often():
    """Threads switch every few bytecodes instead of every 5 ms, so a missing lock shows as a wrong count."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


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
            cache.put(f"{(seed + i) % 97}", b"x" * (i % 60))  # threads share keys: one replaces another's
            cache.get(f"{(i * 7) % 97}")
            seen.append(cache.stats()["bytes"])  # under the lock: a put in flight is over the bound for a moment

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    with switching_often():
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


def test_a_smaller_bound_evicts_now_and_get_or_make_makes_once():
    """A recipe's `model.image_cache_mb` is applied to a loaded policy by setting `max_bytes`: what is held must fit
    the new bound at once, not after the next put."""
    cache = sized(10, 5)
    for key in "abcde":
        cache.put(key, b"xx")
    cache.max_bytes = 4
    assert [k for k in "abcde" if k in cache] == ["d", "e"] and cache.bytes == 4
    cache.max_entries = 1
    assert len(cache) == 1 and "e" in cache and cache.stats()["max_entries"] == 1
    made: list[str] = []
    for _ in range(3):
        assert cache.get_or_make("f", lambda: made.append("f") or b"yy") == b"yy"
    assert made == ["f"] and cache.hits == 2 and "e" not in cache  # made once, kept, the LRU evicted
    assert cache.get_or_make("huge", lambda: b"x" * 9) == b"x" * 9 and "huge" not in cache  # over the bound: not kept
    cache.pop_if("f", lambda v: v == b"other")
    assert "f" in cache
    cache.pop_if("f", lambda v: v == b"yy")
    assert "f" not in cache


def test_every_cache_in_vlmrl_is_a_bounded_lru(policy):
    """Issue 43 item 5: one cache mechanism. A cache that bounds itself its own way (a dict cleared at N entries, a
    class of its own without a lock) is what let refused requests pin memory; a new one must be a BoundedLRU too."""
    from vlmrl.data.images import IMAGE_CACHE
    from vlmrl.reclip.step import Scorer
    from vlmrl.rewards import mathcheck
    from vlmrl.rewards.judge import JudgeCache

    caches = {"processor token ids": policy.processor.token_rows, "processor prompt texts":
              policy.processor.prompt_texts, "processor images": policy.processor.image_cache.lru,
              "vision features": policy.family.vision_cache, "decoded images": IMAGE_CACHE,
              "math verdicts": mathcheck._CACHE, "judge replies": JudgeCache(None)._memory,
              "ReCLIP judgements": Scorer(None, None).cache}
    for name, cache in caches.items():
        assert isinstance(cache, BoundedLRU), name
        assert 0 < cache.max_bytes <= 2**30 and 0 < cache.max_entries, (name, cache.stats())


def test_the_processor_image_cache_is_shared_safely_by_threads(policy, count_samples):
    """The server's thread pool processes requests' images while the generation thread runs: the processor's image
    cache is used from several threads at once, and stays within its bound with its byte count right."""
    from vlmrl.models.image_cache import ImageCache

    proc = policy.processor
    saved, proc.image_cache = proc.image_cache, ImageCache(max_bytes=1)
    one = proc.processed_images([count_samples[0]["images"][0]])
    size = sum(t.numel() * t.element_size() for t in one.vision.values())
    proc.image_cache = ImageCache(max_bytes=4 * size)
    images = [s["images"][0].copy() for s in count_samples]
    expected = {id(im): proc.process_images([im]).tokens for im in images}
    errors: list[BaseException] = []

    def work(seed: int):
        try:
            for i in range(60):
                im = images[(seed * 5 + i * 7) % len(images)]
                assert proc.processed_images([im]).tokens == expected[id(im)]
                assert proc.image_cache.stats()["bytes"] <= 4 * size  # read under the lock
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    try:
        with switching_often():
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        cache = proc.image_cache
        assert not errors, errors[0]
        assert len(cache) <= 4 and cache.bytes == sum(
            sum(t.numel() * t.element_size() for t in entry[1][0].values()) for entry, _ in
            cache.lru._entries.values())
        del images[:]  # collected images leave the cache
        import gc

        gc.collect()
        assert len(cache) == 0 and cache.bytes == 0
    finally:
        proc.image_cache = saved
