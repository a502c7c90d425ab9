"""Beyond one host, the files beside the chart: the Grafana dashboard reads only metrics that exist
(ours from /metrics, Kueue's own), the production-stack values serve the seed's target at TP 8,
and the LeaderWorkerSet manifest is a valid group that Kueue can admit."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import redis
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from eyrie.api import metrics
from eyrie.work import k8s_jobs
from eyrie.work.status_models import RunStatus, TrainStatus
from tests.support.harness import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "eyrie.json"
# Kueue's own metrics (kueue/pkg/metrics): the dashboard's admission panel
KUEUE_METRICS = {"kueue_pending_workloads", "kueue_admitted_active_workloads", "kueue_cluster_queue_resource_usage"}


def our_metric_names(redis_url: str) -> set[str]:
    """What /metrics serves: the collector run against a real Redis with one lease held."""
    from eyrie.work.gpu import GpuLease

    conn = redis.Redis.from_url(redis_url)
    GpuLease(conn, "inference@a").acquire(wait_s=1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.EyrieCollector(conn, store=None))
    served = {line.split()[2] for line in generate_latest(registry).decode().splitlines() if line.startswith("# TYPE")}
    return served | {f.name for f in metrics._run_families().values()}


def test_dashboard_reads_only_metrics_that_exist(redis_url):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:eyrie|kueue)_[a-z_]+)\b", e)}
    ours = our_metric_names(redis_url)
    assert used - ours - KUEUE_METRICS == set()
    for wanted in ("eyrie_queue_jobs", "eyrie_requests_in_flight", "eyrie_tokens_per_second", "eyrie_eta_seconds",
                   "eyrie_gpu_lease_held", "kueue_pending_workloads", "eyrie_acceptance_length"):
        assert wanted in used, f"the dashboard shows no {wanted}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]


def test_acceptance_is_exported_per_run_and_source():
    family = metrics._run_families()["acceptance"]
    # eyrie's from the exported drafter, vLLM's from the run's verify (its manifest's `verify`)
    for run, drafter, verify in (("r1", {"tau": 2.78}, {"vllm_acceptance_length": 3.07}), ("r2", None, None)):
        status = RunStatus(run=run, created_at="2026-12-01T00:00:00Z", target={"model": "t"}, dataset={},
                           stages={"train": TrainStatus(state="done", drafter=drafter, verify=verify)})
        metrics._acceptance(family, run, status)
    assert [(s.labels, s.value) for s in family.samples] == [
        ({"run": "r1", "source": "eyrie"}, 2.78), ({"run": "r1", "source": "vllm"}, 3.07)]


def test_production_stack_serves_the_seeds_target_at_tp8():
    values = yaml.safe_load((ROOT / "deploy" / "vllm-production-stack" / "values-kimi-k2.5.yaml").read_text())
    (model,) = values["servingEngineSpec"]["modelSpec"]
    assert model["modelURL"] == "moonshotai/Kimi-K2.5"
    assert model["vllmConfig"]["tensorParallelSize"] == model["requestGPU"] == 8
    assert "--reasoning-parser" in model["vllmConfig"]["extraArgs"]
    assert values["routerSpec"]["enableRouter"]


def test_leaderworkerset_manifest_is_one_admissible_group():
    lws, service = yaml.safe_load_all((ROOT / "deploy" / "lws" / "kimi-k2.5-multinode.yaml").read_text())
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert lws["metadata"]["labels"][k8s_jobs.QUEUE_LABEL]
    template = lws["spec"]["leaderWorkerTemplate"]
    pods = [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]]
    for pod in pods:  # each pod template is a valid core PodSpec
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod},
                                     "1.33.0", strict=True)
    leader = pods[0]["containers"][0]["args"][0]
    tp = int(re.search(r"--tensor-parallel-size (\d+)", leader).group(1))
    pp = int(re.search(r"--pipeline-parallel-size (\d+)", leader).group(1))
    per_pod = [int(p["containers"][0]["resources"]["limits"][k8s_jobs.GPU_RESOURCE]) for p in pods]
    assert tp * pp == sum(per_pod[:1]) + per_pod[1] * (template["size"] - 1)  # every GPU of the group is used
    kubernetes_validate.validate(service, "1.33.0", strict=True)
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/name"] == lws["metadata"]["name"]
