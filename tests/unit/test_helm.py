"""The Helm chart, rendered by Helm's own SDK (no cluster, no helm binary) for every value set in
deploy/helm/eyrie/ci/, each core object validated strictly against Kubernetes 1.33's schemas, the
custom resources (Kueue, KEDA, Prometheus Operator) checked against what eyrie itself uses, and
the renders compared with tests/golden/helm/ (EYRIE_UPDATE_GOLDEN=1 rewrites them), and what works
each queue tied to eyrie.stages' queues and task kinds."""

from __future__ import annotations

import gzip
import json
import os
from functools import cache

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml

from eyrie.core.config import Settings
from eyrie.core.stage_settings import GenerateSettings
from eyrie.stages import gpu_queues, queues, task_kinds
from eyrie.work import k8s_jobs
from eyrie.work.task_kinds import jobs_for_queue
from eyrie.work.queue import queue
from tests.support.harness import ROOT

CHART = ROOT / "deploy" / "helm" / "eyrie"
GOLDEN = ROOT / "tests" / "golden" / "helm"
KUBERNETES = "1.33.0"  # the Kubernetes version whose schemas every core object must meet
VALUE_SETS = sorted(p.stem for p in (CHART / "ci").glob("*.yaml"))
CUSTOM = {
    *((f"kueue.x-k8s.io/{v}", kind) for v in ("v1beta1", "v1beta2") for kind in ("LocalQueue", "ClusterQueue", "ResourceFlavor")),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
}
RUNS = ("kimi-k2.5-r1", "Team_B.run-with-a-rather-long-name-that-goes-on-and-on-and-on-64ch")


def render_text(values: dict, release: str = "eyrie", namespace: str = "eyrie") -> str:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=release, namespace=namespace)
    return "".join(f"---\n# Source: {name}\n{text.strip()}\n" for name, text in sorted(manifests.items()) if text.strip())


def chart_defaults() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def value_set(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / f"{name}.yaml").read_text())


@pytest.fixture(scope="module", params=VALUE_SETS)
def rendered(request):
    text = render_text(value_set(request.param))
    docs = [d for d in yaml.safe_load_all(text) if d]
    return request.param, value_set(request.param), text, docs


def one(docs, kind, name_suffix=""):
    found = [d for d in docs if d["kind"] == kind and d["metadata"].get("name", "").endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {len(found)}"
    return found[0]


def gpu_jobs(docs) -> dict:
    return json.loads(one(docs, "ConfigMap", "-gpu-jobs")["data"]["gpu-jobs.json"])


def gpus(container: dict) -> int:
    return int((container.get("resources", {}).get("requests") or {}).get(k8s_jobs.GPU_RESOURCE, 0))


def pod_specs(docs):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield d, d["spec"]["template"]["spec"]


def test_golden_render(rendered):
    name, _, text, _ = rendered
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("EYRIE_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden render {golden}: run with EYRIE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{name} renders differently from {golden}: review, then EYRIE_UPDATE_GOLDEN=1"


def test_helm_lint_strict(rendered):
    name, values, _, _ = rendered
    result = helm.lint(str(CHART), values=values, strict=True, kube_version=KUBERNETES, quiet=True)
    assert result["errors"] == [] and [m for m in result["messages"] if m["severity"] > 1] == [], f"{name}: {result}"


def test_core_objects_meet_the_kubernetes_schemas(rendered):
    name, _, _, docs = rendered
    templates = gpu_jobs(docs)
    built = [k8s_jobs.build_job(templates, stage, run) for stage in templates["stages"] for run in RUNS]
    core = [d for d in docs if (d["apiVersion"], d["kind"]) not in CUSTOM] + built
    assert {d["kind"] for d in core} >= {"Deployment", "Service", "ConfigMap", "Role", "RoleBinding", "Job"}
    for doc in core:
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata'].get('name') or doc['metadata'].get('generateName')}: "
                        f"{'.'.join(map(str, exc.path))}: {exc.message}")


CRDS = ROOT / "tests" / "data" / "crds"  # as their projects publish them (tests/data/crds/README.md)


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the openAPIV3Schema its CRD serves, strict (see `_strict`)."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml*")):
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        crd = yaml.safe_load(text)["spec"]
        for version in crd["versions"]:
            if version["served"]:
                schemas[(f"{crd['group']}/{version['name']}", crd["names"]["kind"])] = \
                    _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def _strict(schema):
    """OpenAPI v3 as JSON Schema, the way an API server applies it under strict field validation:
    `nullable` admits null, an object's fields are the listed ones (unless it preserves unknown
    fields or maps names to values)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out and \
            not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_problems(doc: dict) -> list[str]:
    schema = crd_schemas().get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        return [f"no CRD in {CRDS} serves {doc['apiVersion']} {doc['kind']}"]
    return [f"{doc['kind']} {doc['metadata'].get('name')}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: "
            f"{e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]


def test_custom_resources_meet_their_crds(rendered):
    """What a Kubernetes API server with KEDA's, Kueue's and the Prometheus Operator's CRDs accepts
    (server-side apply, Helm 4's default, rejects a `spec:` left null)."""
    name, _, _, docs = rendered
    custom = [d for d in docs if (d["apiVersion"], d["kind"]) in CUSTOM]
    assert "LocalQueue" in {d["kind"] for d in custom}, name
    problems = [p for doc in custom for p in crd_problems(doc)]
    assert not problems, f"{name}: " + "; ".join(problems)


@pytest.mark.parametrize("api", ["kueue.x-k8s.io/v1beta1", "kueue.x-k8s.io/v1beta2"])
def test_every_kueue_object_of_either_api_meets_its_crd(api):
    """The queues and the flavor created, a cohort named, with and without the flavor's node labels."""
    for flavor in ({}, {"nodeLabels": {"nvidia.com/gpu.product": "H200"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}):
        values = {**value_set("compose"),
                  "kueue": {"apiVersion": api, "clusterQueue": {"create": True, "cohort": "shared"},
                            "resourceFlavor": {"create": True, **flavor}}}
        docs = [d for d in yaml.safe_load_all(render_text(values)) if d and d["apiVersion"] == api]
        assert {d["kind"] for d in docs} == {"LocalQueue", "ClusterQueue", "ResourceFlavor"}
        assert [p for doc in docs for p in crd_problems(doc)] == [], (api, flavor)


def test_every_custom_resource_eyrie_targets_has_its_crd():
    assert CUSTOM <= crd_schemas().keys(), CUSTOM - crd_schemas().keys()


def test_the_leaderworkerset_meets_its_crd():
    lws = next(yaml.safe_load_all((ROOT / "deploy" / "lws" / "kimi-k2.5-multinode.yaml").read_text()))
    assert crd_problems(lws) == []


def test_custom_resources_are_the_ones_eyrie_targets(rendered):
    _, values, _, docs = rendered
    custom = {(d["apiVersion"], d["kind"]) for d in docs if "k8s.io/" in d["apiVersion"] or "." in d["apiVersion"].split("/")[0]}
    custom -= {("rbac.authorization.k8s.io/v1", "Role"), ("rbac.authorization.k8s.io/v1", "RoleBinding")}
    assert custom <= CUSTOM, f"unexpected custom resources: {custom - CUSTOM}"
    local = one(docs, "LocalQueue")
    assert local["metadata"]["name"] == values.get("kueue", {}).get("localQueue", {}).get("name", "eyrie")
    assert local["spec"]["clusterQueue"] == cluster_queue_name(values)
    if values["kueue"].get("clusterQueue", {}).get("create"):
        cq = one(docs, "ClusterQueue")
        api = values["kueue"].get("apiVersion", "kueue.x-k8s.io/v1beta1")
        assert {d["apiVersion"] for d in docs if d["apiVersion"].startswith("kueue.")} == {api}
        if values["kueue"]["clusterQueue"].get("cohort"):  # renamed in v1beta2
            assert cq["spec"]["cohortName" if api.endswith("v1beta2") else "cohort"] == values["kueue"]["clusterQueue"]["cohort"]
        flavor = cq["spec"]["resourceGroups"][0]["flavors"][0]
        assert {r["name"] for r in flavor["resources"]} == set(cq["spec"]["resourceGroups"][0]["coveredResources"])
        if values["kueue"].get("resourceFlavor", {}).get("create"):
            assert one(docs, "ResourceFlavor")["metadata"]["name"] == flavor["name"]
    else:
        assert not [d for d in docs if d["kind"] in ("ClusterQueue", "ResourceFlavor")]


def cluster_queue_name(values: dict) -> str:
    return values["kueue"].get("clusterQueue", {}).get("name", "eyrie")


def test_every_gpu_workload_is_queued_in_kueue_and_fits_the_quota(rendered):
    name, values, _, docs = rendered
    queue_name = one(docs, "LocalQueue")["metadata"]["name"]
    for obj, pod in pod_specs(docs):  # nothing the chart deploys by itself holds a GPU
        assert not any(gpus(c) for c in pod["containers"]), f"{obj['kind']} {obj['metadata']['name']} requests GPUs"
    templates = gpu_jobs(docs)
    assert templates["queue"] == queue_name
    quota = values["kueue"]["clusterQueue"]["quota"]["gpus"]
    stages = set(templates["stages"])
    assert {jobs_for_queue(queue)[-1] for queue in gpu_queues()} <= stages  # the Job draining each GPU queue
    for stage in stages:
        job = k8s_jobs.build_job(templates, stage, RUNS[0])
        assert job["metadata"]["labels"][k8s_jobs.QUEUE_LABEL] == queue_name
        assert job["spec"]["suspend"] is True
        asked = k8s_jobs.gpus_of(job)
        assert asked >= 1 or (stage == "extract" and k8s_jobs.reads_extract_server(job)), f"{name}: {stage} asks no GPU"
        assert asked <= quota, f"{name}: {stage} asks {asked} GPUs, the ClusterQueue has {quota}: never admitted"
        for container in job["spec"]["template"]["spec"]["containers"]:
            limits = container["resources"]["limits"].get(k8s_jobs.GPU_RESOURCE, 0)
            assert int(limits) == gpus(container), "GPU requests and limits must be equal"


def queues_worked(docs) -> dict[str, list[str]]:
    """queue -> what works it in a render: a Deployment's container running `worker QUEUE` (its
    image's entrypoint is `eyrie`), a GPU Job template's `eyrie.tasks.gpu_admission drain QUEUE`."""
    worked: dict[str, list[str]] = {}
    for obj, pod in pod_specs(docs):
        for container in pod["containers"]:
            if container.get("args", [])[:1] == ["worker"]:
                worked.setdefault(container["args"][1], []).append(f"{obj['kind']} {obj['metadata']['name']}")
    for job, template in gpu_jobs(docs)["stages"].items():
        for container in template["spec"]["template"]["spec"]["containers"]:
            command = container.get("command", [])
            if "drain" in command:
                worked.setdefault(command[command.index("drain") + 1], []).append(f"gpuJobs {job}")
    return worked


def test_no_worker_of_the_chart_takes_a_queue_no_stage_has(rendered):
    name, _, _, docs = rendered
    assert set(queues_worked(docs)) <= set(queues()), f"{name}: {queues_worked(docs)}"


def test_every_queue_has_its_workers_and_every_job_a_task_kind_names_its_template():
    """eyrie.stages.queues(), read from the code: with the chart's defaults, a CPU queue is worked by a
    Deployment's workers, a GPU queue by its GPU Job (one of the Jobs its task kinds name, which
    Kueue's dispatch creates); with every GPU Job enabled, the chart's templates are the Jobs the
    task kinds name."""
    worked = queues_worked(default_docs())
    assert sorted(worked) == sorted(queues()), worked
    for queue, by in worked.items():
        if queue in gpu_queues():
            assert [b for b in by if b.startswith("gpuJobs ")] == [f"gpuJobs {jobs_for_queue(queue)[-1]}"], (queue, by)
        else:
            assert all(b.startswith("Deployment ") for b in by), (queue, by)
    values = value_set("seed-8gpu")
    values["gpuJobs"]["serve"] = {"enabled": True}
    every_job = {job for kind in task_kinds().values() for job in (*kind.jobs, *kind.reads_on_demand)}
    assert set(gpu_jobs([d for d in yaml.safe_load_all(render_text(values)) if d])["stages"]) == every_job


def test_two_runs_share_the_quota_in_order():
    values = value_set("two-runs")
    docs = [d for d in yaml.safe_load_all(render_text(values)) if d]
    templates = gpu_jobs(docs)
    quota = values["kueue"]["clusterQueue"]["quota"]["gpus"]
    a, b = (k8s_jobs.build_job(templates, "extract", run) for run in RUNS)
    assert a["metadata"]["generateName"] != b["metadata"]["generateName"]
    assert a["metadata"]["labels"][k8s_jobs.RUN_LABEL] != b["metadata"]["labels"][k8s_jobs.RUN_LABEL]
    assert k8s_jobs.gpus_of(a) + k8s_jobs.gpus_of(b) <= quota  # both admitted at once
    third = k8s_jobs.build_job(templates, "verify", RUNS[0])
    assert k8s_jobs.gpus_of(a) + k8s_jobs.gpus_of(b) + k8s_jobs.gpus_of(third) > quota  # waits for one


def test_generators_scale_on_live_generate_tasks(rendered):
    name, values, _, docs = rendered
    deployment = one(docs, "Deployment", "-generator")
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    timeout = {**chart_defaults()["generator"], **values.get("generator", {})}["requestTimeoutSeconds"]
    assert grace >= timeout, "no room for a warm shutdown"
    autoscaling = values.get("generator", {}).get("autoscaling", {}).get("enabled", True)
    if not autoscaling:
        assert not [d for d in docs if d["apiVersion"].startswith("keda.sh/")]
        return
    scaled = one(docs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["spec"]["minReplicaCount"] == 0
    assert_never_scaled_down_under_running_work(scaled)
    assert_counts_live_tasks_through_the_api(docs)
    trigger = keda_triggers(docs)["redis"]
    rq_key = queue(redis.Redis(), "generate").key  # no connection needed for the key
    assert trigger["metadata"]["listName"] == rq_key == "rq:queue:eyrie-generate"
    ref = trigger_secret(docs, trigger)
    assert (ref["parameter"], ref["key"]) == ("password", "redis-password")
    host, port = trigger["metadata"]["address"].rsplit(":", 1)
    if values.get("redis", {}).get("enabled", True):
        assert one(docs, "Service", "-redis")["metadata"]["name"] == host and port == "6379"


def keda_triggers(docs) -> dict[str, dict]:
    triggers = one(docs, "ScaledObject")["spec"]["triggers"]
    return {t["type"]: t for t in triggers}


def trigger_secret(docs, trigger: dict) -> dict:
    auth = one(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    [ref] = auth["spec"]["secretTargetRef"]
    return ref


def assert_counts_live_tasks_through_the_api(docs, namespace: str = "eyrie") -> None:
    """KEDA asks the api's Service for the generate queue's live tasks (queued, running, waiting
    for a retry), with the token the api itself checks (the same Secret and key)."""
    trigger = keda_triggers(docs)["metrics-api"]
    live = trigger["metadata"]
    api = one(docs, "Service", "-api")
    port = api["spec"]["ports"][0]["port"]
    assert live["url"] == f"http://{api['metadata']['name']}.{namespace}.svc:{port}/queues/generate"
    assert (live["valueLocation"], live["activationTargetValue"], live["authMode"]) == ("live", "0", "bearer")
    ref = trigger_secret(docs, trigger)
    container = one(docs, "Deployment", "-api")["spec"]["template"]["spec"]["containers"][0]
    token = next(e for e in container["env"] if e["name"] == "EYRIE_API_TOKEN")["valueFrom"]["secretKeyRef"]
    assert (ref["parameter"], ref["name"], ref["key"]) == ("token", token["name"], token["key"])


def assert_never_scaled_down_under_running_work(scaled: dict) -> None:
    """The ReplicaSet picks which pods go, busy or not: the HPA KEDA makes never scales down, and
    KEDA takes the workers to zero (idleReplicaCount where minReplicas > 0) once no task is live."""
    spec = scaled["spec"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["selectPolicy"] == "Disabled"
    assert spec["minReplicaCount"] == 0 or spec["idleReplicaCount"] == 0
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec["scaleTargetRef"]["name"]}
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "keda-hpa"},
           "spec": {"scaleTargetRef": target, "minReplicas": 1, "maxReplicas": spec["maxReplicaCount"],
                    "behavior": behavior}}
    kubernetes_validate.validate(hpa, KUBERNETES, strict=True)  # the HPA KEDA makes takes the behavior as it is


REQUIRED_VALUES = {"auth": {"redisPassword": "0123456789abcdef", "apiToken": "fedcba9876543210"},
                   "store": {"credentials": {"accessKey": "a", "secretKey": "b" * 12}}}


def default_docs(api_token: str = REQUIRED_VALUES["auth"]["apiToken"], **generator) -> list[dict]:
    """The chart with its default values, but for the secrets it requires (and `generator` values)."""
    values = {**REQUIRED_VALUES, "auth": {**REQUIRED_VALUES["auth"], "apiToken": api_token},
              "generator": generator}
    return [d for d in yaml.safe_load_all(render_text(values)) if d]


def test_default_values_scale_generators_on_running_tasks_too():
    docs = default_docs()
    assert_counts_live_tasks_through_the_api(docs)
    scaled = one(docs, "ScaledObject")
    assert_never_scaled_down_under_running_work(scaled)
    assert "idleReplicaCount" not in scaled["spec"]
    floor = one(default_docs(autoscaling={"minReplicas": 2}), "ScaledObject")["spec"]
    assert (floor["minReplicaCount"], floor["idleReplicaCount"]) == (2, 0)  # to zero all the same
    assert_never_scaled_down_under_running_work({"spec": floor})


def test_servicemonitor_scrapes_the_api(rendered):
    _, values, _, docs = rendered
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    if not values.get("metrics", {}).get("serviceMonitor", {}).get("enabled", True):
        assert monitors == []
        return
    (monitor,) = monitors
    api = one(docs, "Service", "-api")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= api["metadata"]["labels"].items()
    assert [s for s in docs if s["kind"] == "Service" and selector.items() <= s["metadata"]["labels"].items()] == [api]
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in api["spec"]["ports"]}


def test_the_environment_is_eyries_own_settings(rendered, monkeypatch):
    """Every EYRIE_* variable the chart sets is a setting (of the host, or a generate setting's
    host default), and the literal values validate."""
    _, _, _, docs = rendered
    fields = {f"EYRIE_{name.upper()}" for name in (*Settings.model_fields, *GenerateSettings.model_fields)}
    extra = {"EYRIE_REDIS_PASSWORD"}  # used inside the pod, in the Redis URL
    templates = gpu_jobs(docs)
    pods = [pod for _, pod in pod_specs(docs)]
    pods += [k8s_jobs.build_job(templates, s, RUNS[0])["spec"]["template"]["spec"] for s in templates["stages"]]
    for pod in pods:
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            unknown = {n for n in env if n.startswith("EYRIE_")} - fields - extra
            assert not unknown, f"{container['name']}: not eyrie settings: {unknown}"
            for key in list(os.environ):
                if key.startswith("EYRIE_"):
                    monkeypatch.delenv(key)
            for key, value in env.items():
                if key.startswith("EYRIE_") and value is not None and key not in extra:
                    monkeypatch.setenv(key, value.replace("$(EYRIE_REDIS_PASSWORD)", "pw"))
            Settings().generate_defaults()  # raises on any value eyrie would refuse at start, or when
            # it plans a run's generate stage


@pytest.mark.parametrize("values, problem", [
    ({"store": {"credentials": {"accessKey": "a", "secretKey": "b" * 12}}}, "auth.redisPassword is required"),
    ({"auth": {"redisPassword": "short", "apiToken": "t" * 16}}, "12+ characters"),
    ({"auth": {"existingSecret": "s"}, "store": {"credentials": {"existingSecret": "s"}}, "redis": {"enabled": False}},
     "redis.external.host is required"),
    ({"auth": {"existingSecret": "s"}, "store": {"credentials": {"existingSecret": "s"}},
      "gpuJobs": {"train": {"gpus": 0}}}, "/gpuJobs/train/gpus"),
    ({"auth": {"existingSecret": "s"}, "store": {"credentials": {"existingSecret": "s"}}, "gpuJobs": {"bogus": {}}},
     "'bogus' not allowed"),
])
def test_bad_values_are_refused_with_the_fix(values, problem):
    with pytest.raises(helm.HelmError) as err:
        render_text(values)
    assert problem in str(err.value)


def test_every_value_is_documented_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = chart_defaults()

    def leaves(node, value, path):
        if isinstance(value, dict) and value:
            assert node.get("additionalProperties") is False, f"{path}: unknown keys must be refused"
            for key, sub in value.items():
                assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
                yield from leaves(node["properties"][key], sub, f"{path}.{key}")
        else:
            yield path, node

    for path, node in leaves(schema, defaults, "values"):
        assert node.get("description"), f"{path} has no description"
