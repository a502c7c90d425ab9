"""The GPU lease (real Redis): one owner at a time, waiting visible, a dead owner's lease lapses."""

import threading
import time

import redis

from eyrie.work.gpu import GpuLease, holder


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


# Leases per device set (issue 21, item 8): a key per (host, GPU), taken all at once or not at all.

import pytest

from eyrie.core.config import load_settings
from eyrie.tasks import gpu_admission
from eyrie.work import keys
from eyrie.work.gpu import WHOLE_HOST, default_host, device_set, leases, visible_gpus
from eyrie.work.status_models import GpuHolder


@pytest.fixture
def conn(redis_url, monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)  # the leases below name their GPUs themselves
    return redis.Redis.from_url(redis_url)


def lease(conn, owner, devices="cuda", host="h1", gpu_ids=None, ttl_s=30):
    return GpuLease(conn, owner, devices, ttl_s=ttl_s, host=host, gpu_ids=gpu_ids)


def test_disjoint_device_sets_on_one_host_are_held_together(conn):
    inference = lease(conn, "inference@h1", "all", gpu_ids="0,1,2,3")
    extractor = lease(conn, "extractor@h1", "cuda", gpu_ids="4,5,6")
    trainer = lease(conn, "trainer@h1", "cuda:1", gpu_ids="7,8")  # its CUDA device 1 is the host's GPU 8
    assert inference.acquire(wait_s=1) and extractor.acquire(wait_s=1) and trainer.acquire(wait_s=1)
    assert all(l.held() for l in (inference, extractor, trainer))
    found = leases(conn)
    assert [(h["owner"], h["gpus"], h["gpu_host"]) for h in found["holders"]] == [
        ("inference@h1", ["0", "1", "2", "3"], "h1"), ("extractor@h1", ["4", "5", "6"], "h1"), ("trainer@h1", ["8"], "h1")]
    assert found["holder"]["owner"] == "inference@h1" and found["waiting"] == [] and GpuHolder(**found).holders
    assert conn.get(keys.gpu_device("h1", "8")) == trainer.token.encode()


def test_overlapping_sets_exclude_each_other_and_wait_visibly(conn):
    first = lease(conn, "extractor@h1", "cuda:0,cuda:1", gpu_ids="0,1")
    second = lease(conn, "trainer@h1", "cuda", gpu_ids="1,2")  # GPU 1 in both
    assert first.acquire(wait_s=1)
    assert not second.acquire(wait_s=0.2, poll_s=0.05)
    assert not conn.exists(keys.gpu_device("h1", "2"))  # all or nothing: GPU 2 was not taken alone
    got = []
    thread = threading.Thread(target=lambda: got.append(second.acquire(wait_s=10, poll_s=0.05)))
    thread.start()
    time.sleep(0.3)
    found = leases(conn)
    assert got == [] and found["waiting"] == ["trainer@h1"]
    assert (found["waiters"][0]["gpus"], found["waiters"][0]["gpu_host"]) == (["1", "2"], "h1")
    first.release()
    thread.join()
    assert got == [True] and [h["owner"] for h in leases(conn)["holders"]] == ["trainer@h1"]
    assert leases(conn)["waiters"] == [] and not conn.exists(keys.gpu_device("h1", "0"))
    second.release()
    assert leases(conn) is None and not conn.exists(keys.GPU_LEASE)


def test_the_same_gpu_ids_on_two_hosts_are_held_together(conn):
    a, b = lease(conn, "extractor@a", gpu_ids="0,1", host="a"), lease(conn, "extractor@b", gpu_ids="0,1", host="b")
    assert a.acquire(wait_s=1) and b.acquire(wait_s=1)
    assert {h["gpu_host"] for h in leases(conn)["holders"]} == {"a", "b"}
    a.release()
    assert b.held() and [h["owner"] for h in leases(conn)["holders"]] == ["extractor@b"]


def test_a_lease_that_cannot_name_its_gpus_takes_the_whole_host(conn):
    """No EYRIE_GPU_IDS, NVIDIA_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES: "all" is every GPU of the
    host, which overlaps every set there (and none elsewhere)."""
    whole = lease(conn, "verify@h1", "all")
    assert whole.device_ids == [WHOLE_HOST] and whole.acquire(wait_s=1)
    assert not lease(conn, "trainer@h1", gpu_ids="7").acquire(wait_s=0.2, poll_s=0.05)
    assert lease(conn, "trainer@h2", gpu_ids="7", host="h2").acquire(wait_s=1)
    whole.release()
    one = lease(conn, "trainer@h1", gpu_ids="7")
    assert one.acquire(wait_s=1)
    assert not lease(conn, "verify@h1", "all").acquire(wait_s=0.2, poll_s=0.05)  # GPU 7 of h1 is taken
    one.release()
    assert lease(conn, "verify@h1", "all").acquire(wait_s=1)


def test_a_dead_holders_set_lapses_and_its_renew_then_fails(conn):
    dead = lease(conn, "crashed@h1", gpu_ids="0,1", ttl_s=0.5)  # never renewed, never released
    assert dead.acquire(wait_s=1)
    waiter = lease(conn, "trainer@h1", "cuda:0", gpu_ids="1")
    assert not waiter.acquire(wait_s=0.1, poll_s=0.05)
    assert waiter.acquire(wait_s=3, poll_s=0.05)
    assert [h["owner"] for h in leases(conn)["holders"]] == ["trainer@h1"]  # the lapsed one is gone from status
    with pytest.raises(redis.exceptions.LockNotOwnedError):
        dead.renew()  # GPU 1 is another holder's now
    assert not dead.held() and waiter.held()
    waiter.renew()
    assert conn.pttl(keys.gpu_device("h1", "1")) > 20_000


def test_renew_keeps_a_set_past_its_ttl(conn):
    held = lease(conn, "inference@h1", gpu_ids="0", ttl_s=0.6)
    assert held.acquire(wait_s=1)
    for _ in range(4):
        time.sleep(0.3)
        held.renew()
    assert held.held() and not lease(conn, "other@h1", gpu_ids="0").acquire(wait_s=0.1, poll_s=0.05)


def test_which_gpus_a_device_setting_names(monkeypatch):
    assert device_set("cuda", ["4", "5"]) == ["4", "5"] and device_set("all", None) == [WHOLE_HOST]
    assert device_set("cuda:1", ["4", "5"]) == ["5"] and device_set("cuda:0,cuda:1", None) == ["0", "1"]
    assert device_set("cpu", ["4"]) == [WHOLE_HOST] and device_set("cuda:2", ["4", "5"]) == [WHOLE_HOST]
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    assert visible_gpus() is None and visible_gpus("4,5") == ["4", "5"]
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "4,5,6")  # what Compose's device_ids give a container
    assert visible_gpus() == ["4", "5", "6"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # picks among the container's devices
    assert visible_gpus() == ["6"] and visible_gpus("7") == ["7"]  # EYRIE_GPU_IDS says it outright
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    assert visible_gpus() == ["2"]
    assert default_host() == default_host()  # stable: the kernel's boot id (every container of a machine)


def test_the_stage_lease_reads_host_and_gpus_from_settings(conn):
    settings = load_settings(gpu_host="rack7", gpu_ids="3,4")
    first = gpu_admission.gpu_lease(settings, conn, "trainer@x", "cuda:1")
    assert (first.host, first.device_ids) == ("rack7", ["4"]) and first.acquire(wait_s=1)
    assert gpu_admission.gpu_lease(settings, conn, "extractor@x", "cuda:0").acquire(wait_s=1)
    assert not gpu_admission.gpu_lease(settings, conn, "verify@x", "all").acquire(wait_s=0.1, poll_s=0.05)


# Sharing (issue 23): the vLLM extraction service of a run training on demand (extract.storage hybrid
# or online) leases its GPUs in "share" mode at a --gpu-memory-utilization that leaves the trainer
# room; that run's trainer leases one of them "beside" it. Everyone else ("own") waits for both.

def shared(conn, owner, mode, gpu_ids, devices="cuda", host="h1", ttl_s=30):
    return GpuLease(conn, owner, devices, ttl_s=ttl_s, host=host, gpu_ids=gpu_ids, mode=mode)


def test_a_sharer_and_a_trainer_beside_it_hold_one_gpu_together_in_either_order(conn):
    for first_mode in ("share", "beside"):
        service = shared(conn, "extract-server@h1", "share", "0,1")
        trainer = shared(conn, "trainer@h1", "beside", "1")
        first, second = (service, trainer) if first_mode == "share" else (trainer, service)
        assert first.acquire(wait_s=1) and second.acquire(wait_s=1), first_mode
        assert service.held() and trainer.held()
        assert conn.get(keys.gpu_device("h1", "1") + ":shared") == service.token.encode()
        assert conn.get(keys.gpu_device("h1", "1")) == trainer.token.encode()  # the exclusive key: the trainer's
        found = leases(conn)
        assert sorted((h["owner"], h["mode"], tuple(h["gpus"])) for h in found["holders"]) == [
            ("extract-server@h1", "share", ("0", "1")), ("trainer@h1", "beside", ("1",))]
        assert GpuHolder(**found).holders and "keys" not in found["holder"]
        service.release()
        trainer.release()
        assert leases(conn) is None and not conn.keys("eyrie:gpu:device:*")


def test_an_own_holder_waits_for_the_sharer_and_for_the_trainer_beside_it(conn):
    service, trainer = shared(conn, "extract-server@h1", "share", "0,1"), shared(conn, "trainer@h1", "beside", "1")
    assert service.acquire(wait_s=1) and trainer.acquire(wait_s=1)
    for gpu in ("0", "1"):
        assert not lease(conn, "inference@h1", gpu_ids=gpu).acquire(wait_s=0.1, poll_s=0.05), gpu
    assert not lease(conn, "verify@h1", "all").acquire(wait_s=0.1, poll_s=0.05)  # the whole host overlaps both
    service.release()
    assert lease(conn, "inference@h1", gpu_ids="0").acquire(wait_s=1)  # the sharer's GPU 0 is free now
    waiting = lease(conn, "verify@h1", gpu_ids="1")
    got = []
    thread = threading.Thread(target=lambda: got.append(waiting.acquire(wait_s=10, poll_s=0.05)))
    thread.start()
    time.sleep(0.3)
    assert got == [] and leases(conn)["waiting"] == ["verify@h1"]  # the trainer beside still has GPU 1
    trainer.release()
    thread.join()
    assert got == [True] and waiting.held()


def test_two_sharers_never_share_and_own_or_beside_holders_keep_a_sharer_out(conn):
    service = shared(conn, "extract-server@h1", "share", "0,1")
    assert service.acquire(wait_s=1)
    assert not shared(conn, "extract-server@h1b", "share", "1,2").acquire(wait_s=0.1, poll_s=0.05)
    assert not conn.exists(keys.gpu_device("h1", "2") + ":shared")  # all or nothing
    service.release()
    inference = lease(conn, "inference@h1", gpu_ids="0,1")
    assert inference.acquire(wait_s=1)
    assert not shared(conn, "extract-server@h1", "share", "0,1").acquire(wait_s=0.1, poll_s=0.05)
    assert not shared(conn, "trainer@h1", "beside", "1").acquire(wait_s=0.1, poll_s=0.05)  # beside waits for own
    inference.release()
    trainer = shared(conn, "trainer@h1", "beside", "1")
    assert trainer.acquire(wait_s=1)
    assert not shared(conn, "trainer@h1b", "beside", "1").acquire(wait_s=0.1, poll_s=0.05)  # one trainer a GPU


def test_whole_host_leases_respect_sharing(conn):
    """No GPU ids: the whole host (`*`), in every mode."""
    service = shared(conn, "extract-server@h1", "share", None, devices="all")
    assert service.device_ids == [WHOLE_HOST] and service.acquire(wait_s=1)
    assert not lease(conn, "inference@h1", gpu_ids="3").acquire(wait_s=0.1, poll_s=0.05)
    assert not shared(conn, "extract-server@h1b", "share", "3").acquire(wait_s=0.1, poll_s=0.05)
    trainer = shared(conn, "trainer@h1", "beside", "7")
    assert trainer.acquire(wait_s=1)
    service.release()
    assert not lease(conn, "verify@h1", "all").acquire(wait_s=0.1, poll_s=0.05)  # GPU 7: the trainer's
    assert shared(conn, "extract-server@h1", "share", None, devices="all").acquire(wait_s=1)  # beside it again


def test_a_sharers_lease_lapses_and_renews_as_an_own_one_does(conn):
    dead = shared(conn, "crashed@h1", "share", "0,1", ttl_s=0.5)
    assert dead.acquire(wait_s=1)
    waiter = shared(conn, "extract-server@h1", "share", "1")
    assert not waiter.acquire(wait_s=0.1, poll_s=0.05)
    assert waiter.acquire(wait_s=3, poll_s=0.05)
    assert [h["owner"] for h in leases(conn)["holders"]] == ["extract-server@h1"]
    with pytest.raises(redis.exceptions.LockNotOwnedError):
        dead.renew()
    held = shared(conn, "extract-server@h1b", "share", "4", ttl_s=0.6)
    assert held.acquire(wait_s=1)
    for _ in range(4):
        time.sleep(0.3)
        held.renew()
    assert held.held() and conn.pttl(keys.gpu_device("h1", "4") + ":shared") > 300
    assert not lease(conn, "inference@h1", gpu_ids="4").acquire(wait_s=0.1, poll_s=0.05)
    with pytest.raises(ValueError, match="GPU lease mode 'both'"):
        shared(conn, "x", "both", "5")
