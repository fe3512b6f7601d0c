"""`BoundedLRU`: one small cache that bounds itself by bytes and by entries, for every cache in vlmrl.

Caches here hold things a process sees again (a prompt's token ids, an image's tensors). Bounding one by entry count
alone lets a few huge entries exhaust memory: a server's tokenizer cache once held 556 MB after 8 refused requests.
So every entry is weighed by the caller's `size` function and the cache evicts least recently used entries until both
bounds hold; an entry heavier than the whole byte budget is not kept at all. A lock makes it safe to
share between the server's thread pool and its generation thread. `hits`, `misses` and `evictions` say whether a
cache earns its memory (`stats`).

Every cache of vlmrl is one: a processor's token ids and processed images (vlmrl.models.families.processor), a
frozen vision tower's features (vlmrl.models.vision_cache), user data's decoded images (vlmrl.data.images), the
math checker's verdicts (vlmrl.rewards.mathcheck), a judge's replies in memory (vlmrl.rewards.judge) and ReCLIP's
judged rewards (vlmrl.reclip.step). Setting `max_bytes` or `max_entries` evicts down to the new bound at once (a
recipe's `model.image_cache_mb` applied to a loaded policy).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """A thread-safe least-recently-used map bounded by `max_bytes` (the sum of `size(key, value)`) and `max_entries`.
    Either bound may be 0 to turn the cache off (nothing is kept); `put` says whether the entry was kept."""

    def __init__(self, max_bytes: int, max_entries: int, size: Callable[[K, V], int]):
        self._check(max_bytes, max_entries)
        self._max_bytes, self._max_entries, self._size = max_bytes, max_entries, size
        self.bytes = self.hits = self.misses = self.evictions = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        # reentrant: a weak reference's callback (an entry dropped when its key object is collected) can run inside
        # a locked section, when a garbage collection starts there
        self._lock = threading.RLock()

    @staticmethod
    def _check(max_bytes: int, max_entries: int) -> None:
        if max_bytes < 0 or max_entries < 0:
            raise ValueError(f"BoundedLRU: max_bytes={max_bytes} and max_entries={max_entries} must be >= 0")

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self.resize(value, self._max_entries)

    @property
    def max_entries(self) -> int:
        return self._max_entries

    @max_entries.setter
    def max_entries(self, value: int) -> None:
        self.resize(self._max_bytes, value)

    def resize(self, max_bytes: int, max_entries: int) -> None:
        """New bounds, the least recently used entries evicted down to them now."""
        self._check(max_bytes, max_entries)
        with self._lock:
            self._max_bytes, self._max_entries = int(max_bytes), int(max_entries)
            self._evict()

    def __getstate__(self) -> dict:
        """A copy (`copy.deepcopy` of a policy, whose processor holds caches) gets the entries and a lock of its own."""
        with self._lock:
            state = dict(self.__dict__)
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value for `key` (now the most recently used), or `default`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return default
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: K, value: V) -> bool:
        """Keep `value` under `key`, evicting the least recently used entries past either bound. False when the entry
        alone is over the byte budget (or the cache is off): it is not kept, and nothing else is evicted for it."""
        size = int(self._size(key, value))
        with self._lock:
            self._drop(key)
            if size > self._max_bytes or self._max_entries == 0:
                return False
            self._entries[key] = (value, size)
            self.bytes += size
            self._evict()
            return True

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The value under `key`, else `make()`, kept if it fits. `make` runs outside the lock: two threads may make
        one value, never wait on each other's; the first one kept stays."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry[0]
            self.misses += 1
        value = make()
        size = int(self._size(key, value))
        with self._lock:
            if key not in self._entries and size <= self._max_bytes and self._max_entries > 0:
                self._entries[key] = (value, size)
                self.bytes += size
                self._evict()
        return value

    def pop(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            self._drop(key)
            return None if entry is None else entry[0]

    def pop_if(self, key: K, test: Callable[[V], bool]) -> None:
        """Remove the entry under `key` only when `test(value)` holds (a weak reference's callback removes the entry
        of the object that died, not a newer one kept under the same key)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and test(entry[0]):
                self._drop(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        """Entries, bytes and the counters, for logs and /healthz-style reports."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self._max_bytes,
                    "max_entries": self._max_entries, "hits": self.hits, "misses": self.misses,
                    "evictions": self.evictions}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _evict(self) -> None:
        while self._entries and (self.bytes > self._max_bytes or len(self._entries) > self._max_entries):
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def _drop(self, key: K) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]
