"""The Compose stack, checked without a Docker engine: both files against the compose-spec schema,
the GPU merge (with a Compose CLI when one is installed, otherwise a PyYAML deep merge), build
contexts and Dockerfiles, that .env.example documents every variable the files use, and that each
queue of eyrie.stages has its workers' service (and no service works another)."""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyrie.stages import PIPELINE, queues
from tests.support.harness import ROOT

COMPOSE = ROOT / "docker-compose.yml"
GPU = ROOT / "compose.gpu.yml"
CI = ROOT / "compose.ci.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERIGNORE = ROOT / ".dockerignore"
CHECK_JSONSCHEMA = Path(sys.executable).with_name("check-jsonschema")

SERVICES = {"preflight", "redis", "minio", "minio-init", "inference", "generator", "extractor", "trainer", "api",
            "extract-server", "verifier"}
BUILT = {"inference", "generator", "extractor", "trainer", "api"}
GPU_SERVICES = {"inference", "extractor", "trainer", "extract-server", "verifier"}
IMAGE_OF = {"extract-server": "inference", "verifier": "inference"}  # the same image, another command
# The service packages each image needs: its own; the extractor's planner wherever a task's callback
# may continue a planned extract stage (eyrie.runs.pipeline.advance); the extractor's vLLM command and
# connector and the trainer's verify in the inference image (extraction server, verify Job).
# The service packages each image copies (issue 32: the API's none, a stage's image only its own; the
# inference image also runs vLLM's extraction server and the verify worker). tests/e2e/test_compose_e2e.py
# checks the built images hold these; tests/unit/test_architecture.py that they hold what their workers call.
PACKAGES_OF = {"api": set(), "generator": {"generator"}, "extractor": {"extractor"}, "trainer": {"trainer"},
               "inference": {"inference", "extractor", "trainer"}}
ONE_SHOT = {"preflight", "minio-init"}
WORKER_QUEUE = {s.worker: s.queue for s in PIPELINE}  # each stage's workers' service (eyrie.stages: `worker`)
COMMON_ENV = {"EYRIE_REDIS_URL", "EYRIE_STORE_URL", "EYRIE_S3_ENDPOINT", "EYRIE_S3_ACCESS_KEY",
              "EYRIE_S3_SECRET_KEY"}

VAR_REF = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|(?:^|_)TOKEN(?:$|_)|ACCESS_KEY|API_KEY|PRIVATE_KEY",
                         re.I)


# ---------------------------------------------------------------------------------------------
# helpers


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def env_example() -> tuple[dict[str, str], set[str]]:
    """(variables set in .env.example, variables only documented there as commented-out lines)."""
    values, commented = {}, set()
    for line in ENV_EXAMPLE.read_text().splitlines():
        if m := re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", line.strip()):
            values[m[1]] = m[2]
        elif m := re.fullmatch(r"#\s*([A-Z_][A-Z0-9_]*)=.*", line.strip()):
            commented.add(m[1])
    return values, commented


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ${V}, ${V:-d}, ${V-d}, ${V:?e}, ${V?e}; $$ is a literal $."""
    def sub(m: re.Match) -> str:
        name, op, arg = m[1], m[2], m[3]
        value = env.get(name)
        if op in (":-", "-"):
            return arg if value is None or (op == ":-" and value == "") else value
        if op in (":?", "?"):
            if value is None or (op == ":?" and value == ""):
                raise ValueError(f"required variable {name} is missing a value: {arg}")
            return value
        return value or ""
    return VAR_REF.sub(sub, text).replace("$$", "$")


def interpolate_tree(node, env: dict[str, str]):
    """Interpolate every string of a parsed file, as Compose does (after parsing, not before)."""
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate_tree(value, env) for value in node]
    return interpolate(node, env) if isinstance(node, str) else node


def deep_merge(base, override):
    """Compose's merge of several -f files for mappings (later files win key by key)."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = deep_merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    return copy.deepcopy(override)


def compose_cli() -> list[str] | None:
    """`docker compose` (v2 plugin) or `docker-compose` (v1 from Debian, or a v2 binary)."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True,
                               timeout=60)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def merged_config(env_file: Path = ENV_EXAMPLE) -> tuple[dict, str]:
    """The merged, interpolated stack and how it was obtained."""
    cli = compose_cli()
    if cli:
        version = subprocess.run([*cli, "version"], capture_output=True, text=True, timeout=60).stdout
        proc = subprocess.run([*cli, "--env-file", str(env_file), "-f", str(COMPOSE), "-f", str(GPU),
                               "config"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{' '.join(cli)} config failed:\n{proc.stderr}"
        return yaml.safe_load(proc.stdout), f"{' '.join(cli)} config ({version.splitlines()[0]})"
    env = dotenv(env_file)
    docs = [interpolate_tree(load(p), env) for p in (COMPOSE, GPU)]
    merged = deep_merge(docs[0], docs[1])
    for service in merged["services"].values():  # pass-through variables resolve from the env file
        environment = service.get("environment") or {}
        for key, value in list(environment.items()):
            if value is None and key in env:
                environment[key] = env[key]
    return merged, "PyYAML deep merge (no Compose CLI on PATH)"


def dotenv(path: Path) -> dict[str, str]:
    return dict(re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", line.strip()).groups()
                for line in path.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#"))


def gpu_devices(service: dict) -> list[dict]:
    return (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
            ).get("devices") or []


def dockerfile_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        current += raw.rstrip().removesuffix("\\") + " " if raw.rstrip().endswith("\\") else raw
        if not raw.rstrip().endswith("\\"):
            if current.strip():
                lines.append(current.strip())
            current = ""
    return lines


def secrets_in(text: str) -> list[str]:
    """Secret-looking ENV/ARG values, or `NAME=value` pairs of secret-looking names anywhere."""
    found = []
    for line in dockerfile_lines(text):
        instr = line.split(None, 1)[0].upper()
        rest = line.split(None, 1)[1] if " " in line else ""
        if instr in ("ENV", "ARG"):
            pairs = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)(?:=(\"[^\"]*\"|'[^']*'|\S*))?", rest)
            if instr == "ENV" and "=" not in rest and len(rest.split()) >= 2:  # legacy `ENV K V`
                pairs = [(rest.split()[0], rest.split(None, 1)[1])]
            found += [f"{instr} {k}" for k, v in pairs if SECRET_NAME.search(k) and v.strip("\"'")]
        if instr not in ("ENV", "ARG"):
            found += [m[0] for m in re.finditer(r"\b(\w+)=[^\s\"']+", line) if SECRET_NAME.search(m[1])]
    return found


def final_user(lines: list[str]) -> str | None:
    users = [line.split(None, 1)[1].strip() for line in lines if line.upper().startswith("USER ")]
    return users[-1] if users else None


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Enough of .dockerignore's rules for our COPY sources: last matching pattern wins."""
    ignored = False
    rel = rel.rstrip("/")
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/").removeprefix("./")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/"))
               for p in prefixes):
            ignored = not negate
    return ignored


def dockerignore_patterns() -> list[str]:
    return [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


# ---------------------------------------------------------------------------------------------
# schema


@pytest.mark.parametrize("path", [COMPOSE, GPU], ids=lambda p: p.name)
def test_compose_file_matches_compose_spec(path):
    proc = subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_check_rejects_a_broken_file(tmp_path):
    """The validator really validates: a misspelt key and a bad depends_on condition fail."""
    broken = load(COMPOSE)
    broken["services"]["redis"]["healthcheck"]["retrys"] = 5
    broken["services"]["generator"]["depends_on"]["redis"]["condition"] = "service_ready"
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    proc = subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "retrys" in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# the merge of docker-compose.yml + compose.gpu.yml


def test_gpu_merge_reserves_devices_for_gpu_services(capsys):
    config, how = merged_config()
    with capsys.disabled():
        print(f"\n[test_compose] merge checked with: {how}")
    services = config["services"]
    assert set(services) == SERVICES, how
    for name in GPU_SERVICES:
        devices = gpu_devices(services[name])
        assert len(devices) == 1, f"{name}: {devices} ({how})"
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], how
        assert "count" not in devices[0], f"{name}: a count means GPUs 0..N-1 ({how})"
        assert all(re.fullmatch(r"\d+(,\d+)*", i) for i in devices[0]["device_ids"]), how
        # the merge kept the base file's definition (it did not replace the service)
        assert services[name]["build"]["dockerfile"] == f"services/{IMAGE_OF.get(name, name)}/Dockerfile", how
        assert COMMON_ENV <= set(services[name]["environment"]), how
    for name in SERVICES - GPU_SERVICES:
        assert not gpu_devices(services[name]), f"{name} must not reserve GPUs ({how})"


def gpu_ids(config: dict, name: str) -> set[str]:
    return {i for ids in gpu_devices(config["services"][name])[0]["device_ids"] for i in ids.split(",")}


def test_gpu_services_get_device_ids_from_env(tmp_path):
    """Each GPU service takes its ids from .env (.env.example: an 8-GPU host, all 8 for inference's
    tensor parallel 8, one of them for the trainer); Compose stops when one is unset. The lists may
    share GPUs (the GPU lease never gives one GPU two holders): `eyrie run --plan` checks them
    against the run (tests/unit/test_plan_refusals.py)."""
    raw = GPU.read_text()
    assert {m[1] for m in VAR_REF.finditer(raw)} == {"EYRIE_INFERENCE_GPU_IDS", "EYRIE_EXTRACTOR_GPU_IDS",
                                                     "EYRIE_TRAINER_GPU_IDS"}
    assert "count:" not in raw
    config, how = merged_config()
    ids = {name: gpu_ids(config, name) for name in GPU_SERVICES}
    # the vLLM extraction server serves the same target on inference's GPUs, after it (GPU lease)
    assert ids.pop("extract-server") == ids["inference"], how
    assert ids.pop("verifier") == ids["inference"], how  # it serves the target too, after training
    assert set.union(*ids.values()) == {str(i) for i in range(8)}, how
    assert ids["inference"] == {str(i) for i in range(8)} and len(ids["trainer"]) == 1, how
    values, _ = env_example()
    assert int(values["EYRIE_TENSOR_PARALLEL_SIZE"]) == len(ids["inference"]), how
    overlapping = tmp_path / "overlap.env"
    overlapping.write_text(ENV_EXAMPLE.read_text() + "\nEYRIE_TRAINER_GPU_IDS=3\n")
    config, how = merged_config(overlapping)
    assert gpu_ids(config, "trainer") & gpu_ids(config, "inference") == {"3"}, how


def test_merge_fallback_agrees_with_the_files():
    """The PyYAML path on its own (what runs where no Compose CLI is installed)."""
    env, _ = env_example()
    base, gpu = (interpolate_tree(load(p), env) for p in (COMPOSE, GPU))
    merged = deep_merge(base, gpu)
    assert merged["services"]["inference"]["ports"] == base["services"]["inference"]["ports"]
    assert gpu_devices(merged["services"]["trainer"])[0]["device_ids"] == [env["EYRIE_TRAINER_GPU_IDS"]]
    assert merged["services"]["inference"]["environment"]["EYRIE_REDIS_URL"] == (
        f"redis://:{env['EYRIE_REDIS_PASSWORD']}@redis:6379/0")
    with pytest.raises(ValueError, match="EYRIE_REDIS_PASSWORD"):
        interpolate_tree(load(COMPOSE), {k: v for k, v in env.items() if k != "EYRIE_REDIS_PASSWORD"})


# ---------------------------------------------------------------------------------------------
# services


def test_services_are_wired_as_the_stack_needs():
    services = load(COMPOSE)["services"]
    assert set(services) == SERVICES
    for name, svc in services.items():
        assert svc.get("networks") == ["eyrie"], name
        if name not in ONE_SHOT:
            assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        image = svc.get("image")
        if image:  # pinned: an explicit tag, never latest
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), image
    assert "--appendonly yes" in " ".join(services["redis"]["command"])
    assert "ports" not in services["redis"] and "ports" not in services["minio"]
    # Docker Hub stopped serving minio/minio and minio/mc (2026-09); quay.io has the same tags
    assert re.fullmatch(r"quay\.io/minio/minio:RELEASE\.\d{4}-.*", services["minio"]["image"])
    assert re.fullmatch(r"quay\.io/minio/mc:RELEASE\.\d{4}-.*", services["minio-init"]["image"])
    for name in BUILT:  # an init as PID 1: signals reach eyrie, dead children are reaped
        assert services[name].get("init") is True, name
    # the trainer's local copy of the hidden states: a host path the user sizes, not a named volume
    assert "${EYRIE_TRAINER_CACHE_DIR:-./trainer-cache}:/home/eyrie/.cache/eyrie" in services["trainer"]["volumes"]
    assert all(not v.startswith("trainer-cache:") for v in services["trainer"]["volumes"])
    assert "${EYRIE_DATA_DIR:-./data}:/data" in services["minio"]["volumes"]
    assert "mc mb --ignore-existing" in " ".join(services["minio-init"]["command"])
    gen = services["generator"]
    assert "container_name" not in gen and "ports" not in gen, "generator must scale"
    for name in BUILT - {"inference"}:
        deps = services[name]["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy", name
        assert deps["minio"]["condition"] == "service_healthy", name
        assert deps["minio-init"]["condition"] == "service_completed_successfully", name
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    assert services["inference"]["depends_on"]["redis"]["condition"] == "service_healthy"
    # each worker service's healthcheck looks for its queue's worker: checked with its queue, below


def test_service_environment():
    services = load(COMPOSE)["services"]
    for name in BUILT:
        env = services[name]["environment"]
        assert COMMON_ENV <= set(env), name
        assert env["EYRIE_REDIS_URL"] == "redis://:${EYRIE_REDIS_PASSWORD:?set EYRIE_REDIS_PASSWORD in .env}@redis:6379/0"
        assert env["EYRIE_STORE_URL"] == "s3://${EYRIE_BUCKET:-eyrie}"
        assert env["EYRIE_S3_ENDPOINT"] == "http://minio:9000"
    inf = services["inference"]
    env = inf["environment"]
    for key in ("EYRIE_MODEL", "EYRIE_TENSOR_PARALLEL_SIZE", "EYRIE_REASONING_PARSER",
                "EYRIE_MAX_MODEL_LEN", "EYRIE_SERVE_DEADLINE_S", "EYRIE_ADVERTISE_URL"):
        assert key in env, key
    assert env["EYRIE_ADVERTISE_URL"] == "http://inference:8000" and env["EYRIE_SERVER"] == "vllm"
    # optional integers must be pass-through: an empty value would fail eyrie's config at start
    assert env["EYRIE_MAX_MODEL_LEN"] is None
    assert inf["shm_size"] and any(p.endswith(":8000") and "${EYRIE_INFERENCE_PORT:-8000}" in p
                                   for p in inf["ports"])
    assert any(v.endswith(":/models:ro") for v in inf["volumes"])
    assert any(v.startswith("hf-cache:") for v in inf["volumes"])


def test_env_example_documents_every_variable():
    used = set()
    for path in (COMPOSE, GPU):
        used |= {m[1] for m in VAR_REF.finditer(path.read_text())}
        for svc in load(path)["services"].values():  # pass-through variables (no value)
            env = svc.get("environment") or {}
            used |= {k for k, v in (env.items() if isinstance(env, dict) else []) if v is None}
    values, commented = env_example()
    documented = set(values) | commented
    assert used - documented == set(), f"not in .env.example: {sorted(used - documented)}"
    assert documented - used == set(), f"in .env.example but unused: {sorted(documented - used)}"
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):  # one comment line above each variable
        if re.match(r"#?\s*[A-Z_][A-Z0-9_]*=", line):
            above = lines[i - 1]
            assert above.startswith("# ") and not re.match(r"#\s*[A-Z_][A-Z0-9_]*=", above), line
    required = {m[1] for p in (COMPOSE, GPU) for m in VAR_REF.finditer(p.read_text()) if m[2] == ":?"}
    assert required and required <= set(values), f"required but unset: {required - set(values)}"
    for name, value in values.items():  # placeholders only, never a real secret
        if SECRET_NAME.search(name):
            assert value.startswith("change-me"), f"{name} must be a change-me placeholder"


def image_argv(build: dict) -> tuple[list[str], list[str]]:
    """(ENTRYPOINT, CMD) of the image a service builds, as its Dockerfile's last ones say."""
    lines = dockerfile_lines((ROOT / build["context"] / build["dockerfile"]).read_text())
    last = {instr: json.loads(line.split(None, 1)[1]) for line in lines for instr in ("ENTRYPOINT", "CMD")
            if line.split(None, 1)[0].upper() == instr}
    return last.get("ENTRYPOINT", []), last.get("CMD", [])


def worker_queue(service: dict) -> str | None:
    """The queue of a service that runs `eyrie worker QUEUE`: its entrypoint and command, the image's
    where it sets none (an entrypoint set in Compose drops the image's CMD, as Docker does)."""
    entrypoint, command = image_argv(service["build"]) if "build" in service else ([], [])
    if "entrypoint" in service:
        entrypoint, command = service["entrypoint"], []
    argv = [*entrypoint, *service.get("command", command)]
    return argv[2] if argv[:2] == ["eyrie", "worker"] and len(argv) == 3 else None


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, GPU), (COMPOSE, CI)],
                         ids=lambda files: "+".join(p.name for p in files))
def test_every_queue_has_its_stages_worker_service_and_no_worker_takes_another_queue(files):
    """eyrie.stages.queues(), read from the code: a stage's queue is worked by the service its
    `worker` names (its healthcheck looks for that queue's worker), and no service works a queue
    that no stage has, with the GPU or the CPU stack's file merged over the base."""
    services = load(files[0])["services"]
    for overlay in files[1:]:
        services = deep_merge(services, load(overlay)["services"])
    worked = {name: queue for name, svc in services.items() if (queue := worker_queue(svc))}
    assert sorted(set(worked.values())) == sorted(queues()), f"services working each queue: {worked}"
    for s in PIPELINE:
        assert worked.get(s.worker) == s.queue, f"the {s.name} stage's workers are the {s.worker} service"
    for name, queue in worked.items():
        assert f"'rq:worker:{queue}-'" in " ".join(services[name]["healthcheck"]["test"]), name


# ---------------------------------------------------------------------------------------------
# images


@pytest.mark.parametrize("service", sorted(BUILT))
def test_build_context_dockerfile_and_requirements(service):
    build = load(COMPOSE)["services"][service]["build"]
    context = (ROOT / build["context"]).resolve()
    assert context == ROOT and context.is_dir()
    dockerfile = context / build["dockerfile"]
    assert dockerfile.is_file(), dockerfile
    lines = dockerfile_lines(dockerfile.read_text())
    patterns = dockerignore_patterns()
    for line in lines:
        if line.upper().startswith("COPY ") and "--from" not in line:
            sources = [a for a in line.split()[1:-1] if not a.startswith("--")]
            for src in sources:
                assert (context / src).exists(), f"{service}: COPY {src} missing from the context"
                assert not dockerignored(src, patterns), f"{service}: COPY {src} is .dockerignored"
    reqs = ROOT / "services" / service / "requirements.txt"
    assert reqs.is_file()
    assert any(f"-r services/{service}/requirements.txt" in line for line in lines) or \
        f"ARG REQUIREMENTS=services/{service}/requirements.txt" in lines, \
        f"{service}: the Dockerfile must install its requirements.txt"
    for line in reqs.read_text().splitlines():  # nested -r resolve as pip resolves them
        if line.startswith("-r "):
            assert (reqs.parent / line.split(None, 1)[1]).resolve().is_file(), line
    # dependencies before code: the first pip install precedes the COPY of the packages
    first_pip = next(i for i, line in enumerate(lines) if "eyrie-pip -" in line)
    first_code = next(i for i, line in enumerate(lines) if line.startswith("COPY eyrie/"))
    assert first_pip < first_code
    assert any("eyrie-pip --no-deps --no-build-isolation ." in line for line in lines)
    # each image holds the service packages its code reaches, and only those (`pip install .`
    # installs the ones copied: pyproject.toml finds them)
    copied = {line.split()[1].rstrip("/") for line in lines if line.startswith("COPY services/")
              and "/eyrie_" in line.split()[1]}
    assert copied == {f"services/{s}/eyrie_{s}" for s in PACKAGES_OF[service]}, f"{service}: copies {sorted(copied)}"


@pytest.mark.parametrize("service", sorted(BUILT))
def test_dockerfile_pinned_non_root_without_secrets(service):
    path = ROOT / "services" / service / "Dockerfile"
    text = path.read_text()
    lines = dockerfile_lines(text)
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    # the base image is a build argument (a local mirror, an air-gapped host); its default is
    # the official image (inference) or eyrie-base, which defaults to the official Python one
    assert [line for line in lines if line.upper().startswith("FROM ")] == ["FROM ${BASE_IMAGE}"]
    assert args["BASE_IMAGE"] == ("vllm/vllm-openai:v0.33.0" if service == "inference" else "eyrie-base")
    base_args = dict(re.findall(r"^ARG (\w+)=(\S+)", (ROOT / "services/base/Dockerfile").read_text(), re.M))
    assert base_args["BASE_IMAGE"] == "python:3.11-slim-bookworm"
    # every pip install goes through eyrie-pip with the wheelhouse and the CA secret mounted
    for line in lines:
        if "eyrie-pip" in line and line.startswith("RUN") and "--no-deps --no-build-isolation ." not in line:
            assert "--mount=type=bind,source=wheelhouse,target=/wheels" in line, line
            assert "--mount=type=secret,id=ca" in line, line
    assert "pip install" not in text.replace("python3 -m pip install --no-deps", ""), "pip outside eyrie-pip"
    user = final_user(lines)
    assert user and user.split(":")[0] not in ("root", "0"), f"{service} runs as {user!r}"
    assert secrets_in(text) == [], f"{service}: {secrets_in(text)}"
    assert any(line.upper().startswith(("ENTRYPOINT", "CMD")) for line in lines)
    if service in WORKER_QUEUE:
        assert f'CMD ["worker", "{WORKER_QUEUE[service]}"]' in text


def test_secret_detector_flags_baked_secrets():
    """The check above can fail: it catches the usual ways a secret gets baked into an image."""
    assert secrets_in("FROM x\nENV EYRIE_S3_SECRET_KEY=hunter22\n")
    assert secrets_in("FROM x\nENV REDIS_PASSWORD hunter22\n")
    assert secrets_in("FROM x\nARG HF_TOKEN=hf_abc\n")
    assert secrets_in("FROM x\nRUN curl -u x https://h?PASSWORD=abc\n")
    assert secrets_in("FROM x\nRUN export AWS_SECRET_ACCESS_KEY=abc && true\n")
    assert not secrets_in("FROM x\nARG HF_TOKEN\nENV EYRIE_PORT=8000 EYRIE_MAX_TOKENS=8192\n")
    assert not secrets_in("FROM x\nRUN PIP_BREAK_SYSTEM_PACKAGES=1 pip install .\n")
    assert final_user(["FROM x", "USER eyrie", "USER root"]) == "root"


def test_dockerignore_keeps_secrets_and_state_out():
    patterns = dockerignore_patterns()
    for path in (".env", ".git", ".venv", ".eyrie", "data", "tests/artifacts"):
        assert dockerignored(path, patterns), path
    for path in ("eyrie", "requirements/base.txt", "pyproject.toml", "services/inference/entrypoint.sh"):
        assert not dockerignored(path, patterns), path


def test_inference_entrypoint_shows_the_real_vllm_command():
    script = ROOT / "services" / "inference" / "entrypoint.sh"
    assert os.access(script, os.X_OK)
    fake_vllm = ROOT / "tests" / "fake_vllm"  # the image's `vllm` on PATH
    env = {**os.environ, "PATH": os.pathsep.join([str(fake_vllm), str(Path(sys.executable).parent), os.environ["PATH"]]),
           "EYRIE_MODEL": "/models/target", "EYRIE_HOST": "0.0.0.0", "EYRIE_PORT": "8000",
           "EYRIE_TENSOR_PARALLEL_SIZE": "8", "EYRIE_REASONING_PARSER": "kimi_k2",
           "EYRIE_MAX_MODEL_LEN": "32768", "EYRIE_VLLM_ARGS": "--max-num-seqs 200 --trust-remote-code"}
    proc = subprocess.run([str(script), "--print-command"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("vllm serve /models/target --host 0.0.0.0 --port 8000 "
                                   "--tensor-parallel-size 8 --reasoning-parser kimi_k2 "
                                   "--max-model-len 32768 --max-num-seqs 200 --trust-remote-code")
    env["EYRIE_MAX_MODEL_LEN"] = ""
    proc = subprocess.run([str(script), "--print-command"], env=env, capture_output=True, text=True,
                          timeout=120)
    # An empty variable (as Compose passes an unset one) means "not set": the flag is left out.
    assert proc.returncode == 0 and "--max-model-len" not in proc.stdout, proc.stderr
    env["EYRIE_TENSOR_PARALLEL_SIZE"] = "zero"
    proc = subprocess.run([str(script), "--print-command"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "EYRIE_TENSOR_PARALLEL_SIZE" in proc.stderr


# ---------------------------------------------------------------------------------------------
# credentials


def preflight(redis_password: str, access_key: str, secret_key: str, dev: str = "0",
              api_token: str = "5be1c0de9a7f42e8b3d6") -> subprocess.CompletedProcess:
    """The preflight service's own script, run by a real shell (Compose's $$ unescaped)."""
    script = load(COMPOSE)["services"]["preflight"]["command"][0].replace("$$", "$")
    env = {"PATH": os.environ["PATH"], "REDIS_PASSWORD": redis_password, "S3_ACCESS_KEY": access_key,
           "S3_SECRET_KEY": secret_key, "API_TOKEN": api_token, "DEV_INSECURE": dev}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)


def test_preflight_refuses_placeholder_and_well_known_credentials():
    strong = "3f9c2a7d41b8e6f0a9c4"
    assert preflight(strong, "eyrie-prod", strong).returncode == 0
    for args, names in [(("change-me-redis-password", "change-me-access-key", "change-me-secret-key"),
                         ["EYRIE_REDIS_PASSWORD", "EYRIE_S3_ACCESS_KEY", "EYRIE_S3_SECRET_KEY"]),
                        ((strong, "minioadmin", "minioadmin"), ["EYRIE_S3_ACCESS_KEY", "EYRIE_S3_SECRET_KEY"]),
                        (("short", "eyrie-prod", strong), ["EYRIE_REDIS_PASSWORD"]),
                        ((strong, "eyrie-prod", ""), ["EYRIE_S3_SECRET_KEY"])]:
        result = preflight(*args)
        assert result.returncode == 1 and "refusing to start" in result.stderr, args
        assert all(n in result.stderr for n in names) and "EYRIE_DEV_INSECURE=1" in result.stderr
    assert preflight("change-me-redis-password", "minioadmin", "minioadmin", dev="1").returncode == 0
    for token in ("change-me-api-token", "short", ""):
        result = preflight(strong, "eyrie-prod", strong, api_token=token)
        assert result.returncode == 1 and "EYRIE_API_TOKEN" in result.stderr, token


def test_api_service_published_locally_with_a_token():
    api = load(COMPOSE)["services"]["api"]
    assert api["environment"]["EYRIE_API_TOKEN"] == "${EYRIE_API_TOKEN:?set EYRIE_API_TOKEN in .env}"
    assert api["ports"] == ["${EYRIE_API_BIND:-127.0.0.1}:${EYRIE_API_PORT:-8080}:8080"]
    assert "/healthz" in " ".join(api["healthcheck"]["test"])
    assert 'CMD ["api"]' in (ROOT / "services" / "api" / "Dockerfile").read_text()


def test_redis_and_minio_start_only_after_the_preflight():
    services = load(COMPOSE)["services"]
    for name in ("redis", "minio"):
        assert services[name]["depends_on"]["preflight"]["condition"] == "service_completed_successfully"


def published(port) -> tuple[str, str]:
    """(host address, container port) of a `ports` entry, short string or Compose's long form."""
    if isinstance(port, dict):
        return port.get("host_ip") or "0.0.0.0", str(port["target"])
    parts = str(port).rsplit(":", 2)
    return (parts[0] if len(parts) == 3 else "0.0.0.0"), parts[-1]


def test_only_the_api_and_inference_are_published_and_only_on_loopback_by_default():
    """Redis and MinIO stay on the stack's network (publishing them takes an override file of your
    own); what is published binds to 127.0.0.1 unless EYRIE_*_BIND says otherwise."""
    raw = load(COMPOSE)["services"]
    assert {name for name, svc in raw.items() if "ports" in svc} == {"api", "inference"}
    for name in ("api", "inference"):
        for port in raw[name]["ports"]:
            assert port.startswith(f"${{EYRIE_{name.upper()}_BIND:-127.0.0.1}}:"), port
    assert all("network_mode" not in svc for svc in raw.values())
    assert '--requirepass "$$REDIS_PASSWORD"' in " ".join(raw["redis"]["command"])
    config, how = merged_config()
    services = config["services"]
    assert {name for name, svc in services.items() if svc.get("ports")} == {"api", "inference"}, how
    assert {published(p) for p in services["api"]["ports"]} == {("127.0.0.1", "8080")}, how
    assert {published(p) for p in services["inference"]["ports"]} == {("127.0.0.1", "8000")}, how
    values, _ = env_example()
    assert values["EYRIE_API_BIND"] == values["EYRIE_INFERENCE_BIND"] == "127.0.0.1"


def test_the_inference_image_constrains_everything_its_base_holds(tmp_path):
    """services/base/image_constraints.py, run by an interpreter with a stack installed (this venv
    stands in for vLLM's image): every installed distribution is a constraint at its installed
    version, our lines for those lose their pins (nothing of the image's moves), others keep them."""
    reqs = tmp_path / "requirements.txt"
    reqs.write_text(f"-r {ROOT / 'services/inference/requirements.txt'}\ntransformers[serving]==0.0.1\n"
                    "not-installed-here==1.0  # kept as pinned\n")
    out_reqs, out_constraints = tmp_path / "reqs.txt", tmp_path / "constraints.txt"
    subprocess.run([sys.executable, str(ROOT / "services/base/image_constraints.py"), str(reqs), str(out_reqs),
                    str(out_constraints)], check=True, timeout=60)
    from importlib.metadata import version

    lines = out_reqs.read_text().split()
    constraints = dict(line.split("==") for line in out_constraints.read_text().split())
    assert constraints["torch"] == version("torch") and constraints["redis"] == version("redis")
    assert "redis" in lines and "requests" in lines and "orjson" in lines  # base.txt, followed, unpinned
    assert "transformers[serving]" in lines and "not-installed-here==1.0" in lines
    assert not [line for line in lines if "==" in line and line != "not-installed-here==1.0"]
