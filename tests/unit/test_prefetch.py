"""The prefetch queue that feeds online training: order kept, at most N results waiting, errors raised where the
result is taken, and a stop mid-stream leaves no thread behind."""

from __future__ import annotations

import threading
import time

import pytest

from eagle3_train.train.prefetch import Prefetcher


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_results_come_in_order_and_never_more_than_depth_wait(depth):
    made, taken, most = [0], [0], [0]
    lock = threading.Lock()

    def make(i: int) -> int:
        with lock:
            made[0] += 1
            most[0] = max(most[0], made[0] - taken[0])
        return i * i

    feed = Prefetcher(make, range(20), depth)
    out = []
    for v in feed:
        with lock:
            taken[0] += 1
        time.sleep(0.002)  # a consumer slower than the producer: the queue fills up
        out.append(v)
    assert out == [i * i for i in range(20)]
    assert most[0] <= max(1, depth + 1)  # the waiting results plus the one being built
    feed.close()


def test_an_error_in_the_producer_is_raised_to_the_consumer():
    def make(i: int) -> int:
        if i == 2:
            raise ValueError("sample 2 failed")
        return i

    feed = Prefetcher(make, range(5), 2)
    assert [next(feed), next(feed)] == [0, 1]
    with pytest.raises(ValueError, match="sample 2"):
        next(feed)
    feed.close()


def test_close_mid_stream_stops_the_thread():
    feed = Prefetcher(lambda i: i, range(10_000), 2)
    assert next(feed) == 0
    feed.close()
    assert feed._thread is not None and not feed._thread.is_alive()
