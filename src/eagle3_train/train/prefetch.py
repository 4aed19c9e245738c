"""Batches built ahead of use: a background thread fetches the next steps' hidden states while this one trains."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class Prefetcher(Iterator[Any]):
    """`make(item)` for each item, in order. With depth N >= 1 one thread works ahead and at most N finished results
    wait in memory (plus the one being built); depth 0 builds each on request. An error in `make` is raised here.

    `wait_s`: seconds the consumer waited for a result (time the training loop was starved by the source).
    """

    def __init__(self, make: Callable[[Any], Any], items: Iterable[Any], depth: int) -> None:
        self.make, self.items, self.depth = make, iter(items), depth
        self.wait_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._work, name="hidden-state-prefetch", daemon=True)
            self._thread.start()

    def _put(self, entry: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            for item in self.items:
                if self._stop.is_set() or not self._put(("item", self.make(item))):
                    return
            self._put(("end", None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(("error", e))

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            if self._thread is None:
                return self.make(next(self.items))
            kind, value = self._queue.get()
        finally:
            self.wait_s += time.perf_counter() - t0
        if kind == "end":
            self._queue.put(("end", None))  # stay exhausted
            raise StopIteration
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        """Stop working ahead and drop what was fetched (a stop mid-epoch; resume fetches it again)."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.1)
                except queue.Empty:
                    pass
            self._thread.join()
