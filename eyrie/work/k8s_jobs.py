"""Kubernetes Jobs for the GPU stages: pure builders (dicts in, dicts out) and a thin API client.

The chart renders one Job template per GPU stage (image, command, GPU requests, volumes, the
Kueue queue label) into a ConfigMap; `build_job` makes a run's Job from it. Kueue admits the
Job (it unsuspends it) when the ClusterQueue's quota has room: that is what the Redis lease does
on one host. The client speaks plain HTTPS to the API server with the pod's service account:
no dependency beyond the standard library."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import ssl
import urllib.error
import urllib.request

from eyrie.core.errors import EyrieError

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
STAGE_LABEL = "eyrie.dev/stage"
RUN_LABEL = "eyrie.dev/run"
RUN_ANNOTATION = "eyrie.dev/run-name"
GPU_RESOURCE = "nvidia.com/gpu"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def run_label(run: str, slug_chars: int = 40) -> str:
    """A label value for any run name (labels: <= 63 characters, alphanumeric at both ends)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")[:slug_chars].strip("-") or "run"
    return f"{slug}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"


def job_prefix(release: str, stage: str, run: str) -> str:
    """generateName of a run's Job: the API server appends 5 characters (names <= 63)."""
    head = f"{release[:12].rstrip('-')}-{stage}-"
    return f"{head}{run_label(run, max(1, 57 - len(head) - 10))}-"


def gpus_of(job: dict) -> int:
    """GPUs the whole Job asks for at once: per pod (every container) times parallelism."""
    pod = job["spec"]["template"]["spec"]
    per_pod = sum(int((c.get("resources", {}).get("limits") or {}).get(GPU_RESOURCE, 0)) for c in pod["containers"])
    return per_pod * int(job["spec"].get("parallelism", 1))


def build_job(templates: dict, stage: str, run: str) -> dict:
    """The Job of one run's GPU stage, from the chart's templates (`gpu-jobs.json`).

    Pure: the template is copied, never changed. `{run}` in a container's args becomes the run."""
    stages = templates.get("stages", {})
    if stage not in stages:
        raise EyrieError(f"no Job template for GPU stage {stage!r} (the chart renders: {', '.join(sorted(stages)) or 'none'}).",
                         f"enable gpuJobs.{stage} in the chart's values, or run that stage elsewhere.")
    job = copy.deepcopy(stages[stage])
    labels = {STAGE_LABEL: stage, RUN_LABEL: run_label(run), QUEUE_LABEL: templates["queue"]}
    meta = job.setdefault("metadata", {})
    meta.pop("name", None)
    meta["generateName"] = job_prefix(templates["release"], stage, run)
    meta["labels"] = {**meta.get("labels", {}), **labels}
    meta["annotations"] = {**meta.get("annotations", {}), RUN_ANNOTATION: run}
    pod = job["spec"]["template"]
    pod.setdefault("metadata", {})["labels"] = {**pod["metadata"].get("labels", {}), STAGE_LABEL: stage,
                                                RUN_LABEL: run_label(run)}
    pod["metadata"]["annotations"] = {**pod["metadata"].get("annotations", {}), RUN_ANNOTATION: run}
    for container in pod["spec"]["containers"]:
        container["args"] = [a.replace("{run}", run) for a in container.get("args", [])]
    # Kueue creates the Job suspended itself; asking for it suspended closes the window in
    # which a Job created before Kueue's webhook answers could start pods unadmitted.
    job["spec"]["suspend"] = True
    if gpus_of(job) < 1 and not reads_extract_server(job):
        raise EyrieError(f"the Job template of {stage!r} requests no {GPU_RESOURCE}.",
                         f"set gpuJobs.{stage}.gpus to 1 or more in the chart's values.")
    return job


def reads_extract_server(job: dict) -> bool:
    """An extract Job whose forward pass runs in vLLM's extraction server needs no GPU itself."""
    env = [e["name"] for c in job["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])]
    return "EYRIE_EXTRACT_VLLM_URL" in env


def job_state(job: dict) -> str:
    """waiting (suspended: not admitted yet), running, succeeded or failed."""
    for cond in job.get("status", {}).get("conditions", []):
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return "succeeded" if cond["type"] == "Complete" else "failed"
    return "waiting" if job.get("spec", {}).get("suspend") else "running"


def load_templates(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise EyrieError(f"no GPU Job templates at {path}.",
                         "mount the chart's gpu-jobs ConfigMap there, or set EYRIE_KUEUE_JOBS_FILE.") from None


class KubeClient:
    """The few calls eyrie makes: create, get and list Jobs in one namespace."""

    def __init__(self, api: str | None = None, namespace: str | None = None):
        in_cluster = api is None
        if in_cluster:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise EyrieError("EYRIE_GPU_SCHEDULER=kueue outside a Kubernetes pod, and no API server given.",
                                 "run inside the cluster (the chart sets it up) or set EYRIE_KUBERNETES_API.")
            api = f"https://{host}:{port}"
        self.api = api.rstrip("/")
        self.namespace = namespace or _read(f"{SA_DIR}/namespace") or "default"
        self._token = _read(f"{SA_DIR}/token") if in_cluster else None
        self._ssl = ssl.create_default_context(cafile=f"{SA_DIR}/ca.crt") if in_cluster else None

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.api + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        if self._token:
            req.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(req, timeout=30, context=self._ssl) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise EyrieError(f"Kubernetes API {method} {path}: {exc.code} {detail}",
                             "check the service account's Role (the chart grants create/get/list/delete on jobs).") from None
        except urllib.error.URLError as exc:
            raise EyrieError(f"cannot reach the Kubernetes API at {self.api} ({exc.reason}).",
                             "check EYRIE_KUBERNETES_API or the pod's network.") from None

    def jobs_path(self) -> str:
        return f"/apis/batch/v1/namespaces/{self.namespace}/jobs"

    def create_job(self, job: dict) -> dict:
        return self._call("POST", self.jobs_path(), job)

    def get_job(self, name: str) -> dict:
        return self._call("GET", f"{self.jobs_path()}/{name}")

    def delete_job(self, name: str) -> dict:
        return self._call("DELETE", f"{self.jobs_path()}/{name}", {"propagationPolicy": "Background"})

    def list_jobs(self, selector: str) -> list[dict]:
        query = urllib.request.quote(selector, safe="=,")
        return self._call("GET", f"{self.jobs_path()}?labelSelector={query}").get("items", [])


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None
