"""`BoundedLRU`: one small cache that bounds itself by bytes and by entries, for every cache in vlmrl.

Caches here hold things a process sees again (a prompt's token ids, an image's tensors). Bounding one by entry count
alone lets a few huge entries exhaust memory: a server's tokenizer cache once held 556 MB after 8 refused requests
(issue 43). So every entry is weighed by the caller's `size` function and the cache evicts least recently used
entries until both bounds hold; an entry heavier than the whole byte budget is not kept at all. A lock makes it safe to
share between the server's thread pool and its generation thread. `hits`, `misses` and `evictions` say whether a
cache earns its memory (`stats`).
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
        if max_bytes < 0 or max_entries < 0:
            raise ValueError(f"BoundedLRU: max_bytes={max_bytes} and max_entries={max_entries} must be >= 0")
        self.max_bytes, self.max_entries, self._size = max_bytes, max_entries, size
        self.bytes = self.hits = self.misses = self.evictions = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """A copy (`copy.deepcopy` of a policy, whose processor holds caches) gets the entries and a lock of its own."""
        with self._lock:
            state = dict(self.__dict__)
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

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
            if size > self.max_bytes or self.max_entries == 0:
                return False
            self._entries[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
                self._drop(next(iter(self._entries)))
                self.evictions += 1
            return True

    def pop(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            self._drop(key)
            return None if entry is None else entry[0]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        """Entries, bytes and the counters, for logs and /healthz-style reports."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "max_entries": self.max_entries, "hits": self.hits, "misses": self.misses,
                    "evictions": self.evictions}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _drop(self, key: K) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]
