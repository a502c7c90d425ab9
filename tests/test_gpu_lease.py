"""The GPU lease (real Redis): one owner at a time, waiting visible, a dead owner's lease lapses."""

import threading
import time

import redis

from eyrie.gpu import GpuLease, holder


def test_one_owner_waiters_visible_and_handover(redis_url):
    conn = redis.Redis.from_url(redis_url)
    inference = GpuLease(conn, "inference@a")
    assert inference.acquire(wait_s=1)
    assert holder(conn)["holder"]["owner"] == "inference@a"

    extractor = GpuLease(conn, "extractor@b")
    got = []
    thread = threading.Thread(target=lambda: got.append(extractor.acquire(wait_s=10, poll_s=0.05)))
    thread.start()
    time.sleep(0.3)
    assert got == [] and holder(conn)["waiting"] == ["extractor@b"]  # never two owners
    inference.release()  # e.g. vLLM exited after generation drained
    thread.join()
    assert got == [True] and holder(conn) == {"holder": holder(conn)["holder"], "waiting": []}
    assert holder(conn)["holder"]["owner"] == "extractor@b"
    extractor.release()
    assert holder(conn) is None


def test_dead_owners_lease_lapses(redis_url):
    conn = redis.Redis.from_url(redis_url)
    assert GpuLease(conn, "crashed", ttl_s=0.5).acquire(wait_s=1)  # never renewed, never released
    assert not GpuLease(conn, "trainer").acquire(wait_s=0.1, poll_s=0.05)
    assert GpuLease(conn, "trainer").acquire(wait_s=3, poll_s=0.05)
