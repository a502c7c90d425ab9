"""GPU ownership behind one interface: the Job builders (pure), the Redis lease unchanged under
EYRIE_GPU_SCHEDULER=redis, and Kueue admission under kueue: enqueueing a GPU stage's tasks
creates the run's Job once (real Redis, the chart's own templates, a stand-in API server)."""

from __future__ import annotations

import copy
import json
import re
import threading

import pytest
import redis
import yaml

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.data.manifest import Layout
from eyrie.data.store import open_store
from eyrie.stages import queues
from eyrie.tasks import gpu_admission
from eyrie.work import k8s_jobs
from eyrie.work.gpu import GpuLease, holder
from eyrie.work.queue import enqueue_task
from eyrie.work.task_kinds import jobs_for_queue, servers_done
from tests.support.kube_stub import KubeStub
from tests.unit.test_helm import gpu_jobs, render_text, value_set

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
EXTRACT_FUNC = "eyrie_extractor.shard.run_extract_shard"
TRAIN_FUNC = "eyrie_trainer.runner.run_train_task"


def chart_templates(value_set_name: str) -> dict:
    return gpu_jobs([d for d in yaml.safe_load_all(render_text(value_set(value_set_name))) if d])


@pytest.fixture(scope="module")
def templates():
    return chart_templates("compose")


@pytest.mark.parametrize("run", ["r1", "Kimi-K2.5_run.01", "x" * 64, "--__..", "A" * 63 + "z"])
def test_build_job_names_and_labels_any_run(templates, run):
    before = copy.deepcopy(templates)
    job = k8s_jobs.build_job(templates, "extract", run)
    assert templates == before  # pure: the template is never changed
    prefix = job["metadata"]["generateName"]
    assert len(prefix) + 5 <= 63 and DNS_LABEL.match(prefix + "abcde")
    labels = job["metadata"]["labels"]
    for value in labels.values():
        assert len(value) <= 63 and LABEL_VALUE.match(value), value
    assert labels[k8s_jobs.QUEUE_LABEL] == templates["queue"] == "eyrie"
    assert labels[k8s_jobs.STAGE_LABEL] == "extract" and labels[k8s_jobs.RUN_LABEL] == k8s_jobs.run_label(run)
    assert job["metadata"]["annotations"][k8s_jobs.RUN_ANNOTATION] == run
    assert job["spec"]["template"]["metadata"]["annotations"][k8s_jobs.RUN_ANNOTATION] == run
    assert job["spec"]["suspend"] is True and "name" not in job["metadata"]


def test_run_labels_differ_for_runs_that_slug_alike():
    assert k8s_jobs.run_label("Run_A") != k8s_jobs.run_label("run-a")


def test_build_job_fills_the_run_into_args_and_counts_gpus(templates):
    verify = k8s_jobs.build_job(templates, "verify", "r7")
    # the verify Job works the run's verify task from its queue, as extract and train do
    assert verify["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "python", "-m", "eyrie.tasks.gpu_admission", "drain", "verify"]
    assert k8s_jobs.gpus_of(verify) == 8
    named = copy.deepcopy(templates)
    named["stages"]["verify"]["spec"]["template"]["spec"]["containers"][0]["args"] = ["--run", "{run}"]
    assert k8s_jobs.build_job(named, "verify", "r7")["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "--run", "r7"]
    wide = copy.deepcopy(templates)
    wide["stages"]["extract"]["spec"]["parallelism"] = 3
    assert k8s_jobs.gpus_of(k8s_jobs.build_job(wide, "extract", "r7")) == 24


def test_build_job_refuses_a_missing_stage_or_a_job_without_gpus(templates):
    with pytest.raises(EyrieError, match="no Job template for GPU stage 'extract-server'.*gpuJobs.extract-server"):
        k8s_jobs.build_job(templates, "extract-server", "r1")
    no_gpu = copy.deepcopy(templates)
    for container in no_gpu["stages"]["train"]["spec"]["template"]["spec"]["containers"]:
        del container["resources"]["requests"][k8s_jobs.GPU_RESOURCE]
        del container["resources"]["limits"][k8s_jobs.GPU_RESOURCE]
    with pytest.raises(EyrieError, match="requests no nvidia.com/gpu.*gpuJobs.train.gpus"):
        k8s_jobs.build_job(no_gpu, "train", "r1")


def test_extract_reading_the_extraction_server_needs_no_gpu():
    seed = chart_templates("seed-8gpu")
    extract = k8s_jobs.build_job(seed, "extract", "r1")
    assert k8s_jobs.gpus_of(extract) == 0 and k8s_jobs.reads_extract_server(extract)
    server = k8s_jobs.build_job(seed, "extract-server", "r1")
    assert k8s_jobs.gpus_of(server) == 8
    args = server["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--layers") + 1] == "2,30,58" and args[args.index("--tensor-parallel-size") + 1] == "8"


@pytest.mark.parametrize("status, state", [
    ({"spec": {"suspend": True}}, "waiting"),
    ({"spec": {"suspend": False}, "status": {"active": 1}}, "running"),
    ({"spec": {}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}, "succeeded"),
    ({"spec": {}, "status": {"conditions": [{"type": "Failed", "status": "True"}]}}, "failed"),
    ({"spec": {}, "status": {"conditions": [{"type": "Failed", "status": "False"}]}}, "running"),
])
def test_job_state(status, state):
    assert k8s_jobs.job_state(status) == state


def test_the_jobs_dispatched_on_enqueue_are_the_ones_the_stages_declare():
    """eyrie.work.queue dispatches on every enqueue through eyrie.work.kueue, below the stages, from what the
    stages' task kinds declare: the servers first, then the Job that drains the queue."""
    assert {q: jobs_for_queue(q) for q in queues()} == {
        "generate": ("serve",), "extract": ("extract-server", "extract"), "train": ("train",), "verify": ("verify",)}
    # a run that trains on demand: the trainer reads the extraction server, which extraction's drain leaves up
    assert jobs_for_queue("train", on_demand=True) == ("extract-server", "train")
    assert {q: servers_done(q, on_demand=True) for q in queues()} == {
        "generate": (), "extract": (), "train": ("extract-server",), "verify": ()}
    assert {q: servers_done(q) for q in queues()} == {
        "generate": (), "extract": ("extract-server",), "train": (), "verify": ()}


def test_redis_scheduler_is_the_lease_unchanged(redis_url, monkeypatch):
    monkeypatch.delenv("EYRIE_GPU_SCHEDULER", raising=False)
    conn = redis.Redis.from_url(redis_url)
    settings = load_settings(redis_url=redis_url)
    first = gpu_admission.gpu_lease(settings, conn, "extractor@a", "cuda")
    assert isinstance(first, GpuLease) and first.acquire(wait_s=1)
    assert holder(conn)["holder"]["owner"] == "extractor@a"
    second = gpu_admission.gpu_lease(settings, conn, "trainer@b", "cuda")
    assert not second.acquire(wait_s=0.2, poll_s=0.05)  # never two owners
    first.release()
    assert second.acquire(wait_s=1, poll_s=0.05)
    second.release()
    # nothing is dispatched: the stage's workers wait for the lease
    assert gpu_admission.dispatch(conn, "extract", "r1") == []


def test_kueue_scheduler_grants_the_admitted_pod_its_gpus(redis_url):
    conn = redis.Redis.from_url(redis_url)
    GpuLease(conn, "someone@else").acquire(wait_s=1)  # a Redis lease plays no part on Kubernetes
    lease = gpu_admission.gpu_lease(load_settings(gpu_scheduler="kueue"), conn, "extractor@pod", "cuda")
    assert lease.acquire(wait_s=0) is True
    lease.renew()
    lease.release()
    assert holder(conn)["holder"]["owner"] == "someone@else"


@pytest.fixture
def kube(tmp_path, monkeypatch, templates):
    stub = KubeStub()
    jobs_file = tmp_path / "gpu-jobs.json"
    jobs_file.write_text(json.dumps(templates))
    for key, value in {"EYRIE_GPU_SCHEDULER": "kueue", "EYRIE_KUEUE_JOBS_FILE": str(jobs_file),
                       "EYRIE_KUBERNETES_API": stub.url, "EYRIE_KUBERNETES_NAMESPACE": "ml"}.items():
        monkeypatch.setenv(key, value)
    yield stub
    stub.close()


def test_enqueueing_a_gpu_stage_creates_the_runs_job_once(redis_url, kube, monkeypatch):
    monkeypatch.setenv("EYRIE_REDIS_URL", redis_url)
    conn = redis.Redis.from_url(redis_url)
    threads = [threading.Thread(target=enqueue_task, args=(conn, "extract", EXTRACT_FUNC, {"run": "r1", "shard": i},
                                                           f"extract-r1-{i}")) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (name,) = kube.jobs  # six tasks enqueued at once: one Job
    job = kube.jobs[name]
    assert name.startswith("eyrie-extract-r1-") and job["metadata"]["namespace"] == "ml"
    assert job["metadata"]["labels"][k8s_jobs.QUEUE_LABEL] == "eyrie" and job["spec"]["suspend"] is True
    assert conn.llen("rq:queue:eyrie-extract") == 6  # the tasks wait in RQ for the Job's worker

    enqueue_task(conn, "extract", EXTRACT_FUNC, {"run": "r1", "shard": 9}, "extract-r1-9")
    kube.admit(name)
    enqueue_task(conn, "extract", EXTRACT_FUNC, {"run": "r1", "shard": 10}, "extract-r1-10")
    assert list(kube.jobs) == [name]  # waiting, then running: still the one Job

    enqueue_task(conn, "extract", EXTRACT_FUNC, {"run": "r2", "shard": 0}, "extract-r2-0")
    assert len(kube.jobs) == 2  # another run, its own Job: Kueue admits them in turn

    kube.finish(name)
    enqueue_task(conn, "extract", EXTRACT_FUNC, {"run": "r1", "shard": 11}, "extract-r1-11")  # a retry, later
    assert len(kube.jobs) == 3

    enqueue_task(conn, "train", TRAIN_FUNC, {"run": "r1"}, "train-r1")
    enqueue_task(conn, "generate", "eyrie_generator.shard.run_generate_shard", {"run": "r1", "shard": 0}, "gen-r1-0")
    stages = sorted(j["metadata"]["labels"][k8s_jobs.STAGE_LABEL] for j in kube.jobs.values())
    assert stages == ["extract", "extract", "extract", "serve", "train"]  # serve: the chart's in-chart server


def test_job_command_waits_for_the_outcome(redis_url, kube, monkeypatch, capsys):
    monkeypatch.setenv("EYRIE_REDIS_URL", redis_url)
    admission = gpu_admission.KueueAdmission(load_settings())
    name = admission.dispatch(redis.Redis.from_url(redis_url), "train", "r1")
    threading.Timer(0.3, kube.finish, args=(name,)).start()
    assert admission.wait(name, timeout_s=10, poll_s=0.05) == "succeeded"
    with pytest.raises(EyrieError, match="still waiting"):
        admission.wait(admission.dispatch(redis.Redis.from_url(redis_url), "verify", "r1"), timeout_s=0.2, poll_s=0.05)
    assert gpu_admission.main(["job", "extract-server", "--run", "r1"]) == 2
    assert "renders no Job template for 'extract-server'" in capsys.readouterr().err


def test_a_job_the_api_server_would_refuse_is_an_error_naming_it(redis_url, kube, tmp_path, monkeypatch, templates):
    broken = copy.deepcopy(templates)
    broken["stages"]["train"]["spec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    (tmp_path / "gpu-jobs.json").write_text(json.dumps(broken))
    with pytest.raises(EyrieError, match="Kubernetes API POST .*422.*bogus"):
        gpu_admission.KueueAdmission(load_settings()).dispatch(redis.Redis.from_url(redis_url), "train", "r1")


def test_drained_extraction_stops_the_runs_extraction_server(redis_url, tmp_path, monkeypatch):
    stub = KubeStub()
    try:
        (tmp_path / "gpu-jobs.json").write_text(json.dumps(chart_templates("seed-8gpu")))
        monkeypatch.setenv("EYRIE_GPU_SCHEDULER", "kueue")
        monkeypatch.setenv("EYRIE_JOB_RUN", "r1")  # the chart's Job template sets it: the Job's run
        settings = load_settings(kueue_jobs_file=str(tmp_path / "gpu-jobs.json"),
                                 kubernetes_api=stub.url, extract_vllm_url="http://eyrie-extract-server:8000")
        conn = redis.Redis.from_url(redis_url)
        admission = gpu_admission.KueueAdmission(settings)
        server = admission.dispatch(conn, "extract-server", "r1")
        other = admission.dispatch(conn, "extract-server", "r2")
        assert gpu_admission.stop_servers(settings, "extract") == [server]
        assert list(stub.jobs) == [other]
    finally:
        stub.close()


def test_a_run_training_on_demand_keeps_its_extraction_server_until_training_drains(redis_url, tmp_path,
                                                                                    monkeypatch):
    """hybrid and online (issue 23): the trainer asks the vLLM extraction server for the states not
    stored, so the server's Job outlives the extract queue: enqueueing the train task finds it (or
    creates it again), and it goes when the train queue drains. An offline run's server goes after
    extraction and its trainer runs alone. The run's storage comes from its manifest in the store."""
    from tests.e2e.test_extract_server import _manifest

    stub = KubeStub()
    try:
        (tmp_path / "gpu-jobs.json").write_text(json.dumps(chart_templates("seed-8gpu")))
        env = {"EYRIE_GPU_SCHEDULER": "kueue", "EYRIE_KUEUE_JOBS_FILE": str(tmp_path / "gpu-jobs.json"),
               "EYRIE_KUBERNETES_API": stub.url, "EYRIE_REDIS_URL": redis_url,
               "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}"}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        store, conn = open_store(load_settings()), redis.Redis.from_url(redis_url)
        for run, storage in (("hy", "hybrid"), ("on", "online"), ("off", "offline")):
            manifest = _manifest()
            extract = manifest.extract.model_copy(update={"storage": storage})
            store.put_json(Layout(run).manifest, manifest.model_copy(update={"run": run, "extract": extract}).model_dump())

        def stages(run: str) -> list[str]:
            return sorted(j["metadata"]["labels"][k8s_jobs.STAGE_LABEL] for j in stub.jobs.values()
                          if j["metadata"]["labels"][k8s_jobs.RUN_LABEL] == k8s_jobs.run_label(run))

        for run in ("hy", "on", "off"):
            enqueue_task(conn, "extract", EXTRACT_FUNC, {"run": run, "shard": 0}, f"extract-{run}-0")
            assert stages(run) == ["extract", "extract-server"]
            settings = load_settings(job_run=run)
            stopped = gpu_admission.stop_servers(settings, "extract")
            assert (stopped == []) == (run != "off"), (run, stopped)
            enqueue_task(conn, "train", TRAIN_FUNC, {"run": run}, f"train-{run}")
            assert stages(run) == (["extract", "extract-server", "train"] if run != "off" else ["extract", "train"])
            assert len(gpu_admission.stop_servers(settings, "train")) == (run != "off")
            assert stages(run) == ["extract", "train"]  # the server went with training

        server_gone = load_settings(job_run="hy")  # a train task retried after the server went: created again
        enqueue_task(conn, "train", TRAIN_FUNC, {"run": "hy"}, "train-hy-retry")
        assert stages("hy") == ["extract", "extract-server", "train"]
        train = next(j for j in stub.jobs.values() if j["metadata"]["labels"][k8s_jobs.STAGE_LABEL] == "train")
        container = train["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "EYRIE_EXTRACT_VLLM_URL", "value": "http://eyrie-extract-server:8000"} in container["env"]
        assert {"name": "shared-hs", "mountPath": "/shared/eyrie-hs"} in container["volumeMounts"]
        assert gpu_admission.stop_servers(server_gone, "train")
    finally:
        stub.close()


def test_missing_templates_or_cluster_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(EyrieError, match="no GPU Job templates at .*EYRIE_KUEUE_JOBS_FILE"):
        gpu_admission.KueueAdmission(load_settings(kueue_jobs_file=str(tmp_path / "none.json")))
    (tmp_path / "t.json").write_text("{}")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(EyrieError, match="outside a Kubernetes pod.*EYRIE_KUBERNETES_API"):
        gpu_admission.KueueAdmission(load_settings(kueue_jobs_file=str(tmp_path / "t.json")))
    with pytest.raises(EyrieError, match="EYRIE_GPU_SCHEDULER"):
        load_settings(gpu_scheduler="slurm")


def test_a_finished_gpu_job_queues_the_jobs_of_tasks_still_waiting(redis_url, kube, monkeypatch):
    """A server admitted while another run extracted handed its GPUs back at once: when the next
    GPU Job has drained its queue (a real burst worker here), the waiting run's server is queued again."""
    monkeypatch.setenv("EYRIE_REDIS_URL", redis_url)
    conn = redis.Redis.from_url(redis_url)
    enqueue_task(conn, "generate", "eyrie_generator.shard.run_generate_shard", {"run": "r2", "shard": 0}, "gen-r2-0")
    (first,) = kube.jobs
    kube.finish(first)  # `eyrie serve` exited 0 without serving
    assert gpu_admission.main(["drain", "train"]) == 0  # the train queue is empty: the Job ends
    waiting = [n for n, j in kube.jobs.items() if k8s_jobs.job_state(j) == "waiting"]
    assert len(waiting) == 1 and kube.jobs[waiting[0]]["metadata"]["labels"][k8s_jobs.STAGE_LABEL] == "serve"
    assert kube.jobs[waiting[0]]["metadata"]["annotations"][k8s_jobs.RUN_ANNOTATION] == "r2"
    assert conn.llen("rq:queue:eyrie-generate") == 1  # the task still waits for the server
