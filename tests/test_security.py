"""Nothing read from Redis or the store is unpickled, checked statically over eyrie/ and services/:
no pickle-family module, no torch.load, eval, exec or unsafe yaml.load outside a short allow-list
(each entry says why it never sees data from Redis or the store), and every RQ queue, worker and
job fetch uses the JSON serializer. `assert_no_pickles` checks a store's objects themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE = [p for d in ("eyrie", "services") for p in sorted((ROOT / d).rglob("*.py"))]

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve", "marshal", "pickletools"}
UNSAFE_CALLS = {"torch.load", "eval", "exec", "yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all",
                "yaml.unsafe_load_all", "numpy.load", "np.load", "pandas.read_pickle", "pd.read_pickle",
                "torch.serialization.load", "pickle.loads", "pickle.load"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "yaml.SafeLoader", "yaml.CSafeLoader"}
RQ_CALLS = {"Queue", "Worker", "SimpleWorker", "worker_class", "Job.fetch", "Job.fetch_many", "Job.create",
            "Worker.all", "SimpleWorker.all"}

# (file, call) -> why it is safe. Exact: each entry must match exactly once.
ALLOWED = {
    ("services/trainer/eyrie_trainer/tensorfile.py", "torch.load"):
        "split(): the optimizer/scheduler state speculators torch.save'd on this host a moment ago, read "
        "(weights_only=True) to turn it into safetensors + JSON before upload; never an object from the store",
}

PICKLE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return "?"


def findings(path: Path) -> list[tuple[str, int, str]]:
    """(kind, line, what) for every unsafe import, unsafe call, and RQ call without a serializer."""
    tree, found = ast.parse(path.read_text(), str(path)), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [("import", node.lineno, n) for n in names if n.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.Call):
            name, keywords = dotted(node.func), {k.arg: k.value for k in node.keywords}
            if name in UNSAFE_CALLS and not _safe_call(name, keywords):
                found.append(("call", node.lineno, name))
            if name in RQ_CALLS and "serializer" not in keywords:
                found.append(("rq-without-json-serializer", node.lineno, name))
    return found


def _safe_call(name: str, keywords: dict) -> bool:
    if name.startswith("yaml.") and name != "yaml.unsafe_load":
        return dotted(keywords["Loader"]) in SAFE_YAML_LOADERS if "Loader" in keywords else False
    if name in ("numpy.load", "np.load"):
        allow = keywords.get("allow_pickle")
        return allow is None or (isinstance(allow, ast.Constant) and allow.value is False)
    return False


def test_no_unpickling_of_anything_read_from_redis_or_the_store():
    assert len(CODE) > 30  # the scan sees the code
    seen, problems = {}, []
    for path in CODE:
        rel = path.relative_to(ROOT).as_posix()
        for kind, line, what in findings(path):
            if (rel, what) in ALLOWED and kind == "call":
                seen[(rel, what)] = seen.get((rel, what), 0) + 1
            else:
                problems.append(f"{rel}:{line}: {kind} {what}")
    assert problems == [], "unsafe deserialization (or RQ without JSONSerializer):\n" + "\n".join(problems)
    assert seen == {key: 1 for key in ALLOWED}, f"allow-list out of date: {seen}"


@pytest.mark.parametrize("source, expected", [
    ("import pickle", ["import pickle"]),
    ("from joblib import load", ["import joblib"]),
    ("import dill.settings", ["import dill.settings"]),
    ("import torch\ntorch.load(p)", ["call torch.load"]),
    ("x = eval(s)", ["call eval"]),
    ("model.eval()", []),
    ("import yaml\nyaml.load(s)", ["call yaml.load"]),
    ("import yaml\nyaml.load(s, Loader=yaml.SafeLoader)", []),
    ("import yaml\nyaml.safe_load(s)", []),
    ("import numpy as np\nnp.load(p, allow_pickle=True)", ["call np.load"]),
    ("import numpy as np\nnp.load(p)", []),
    ("Queue('q', connection=c)", ["rq-without-json-serializer Queue"]),
    ("Job.fetch(i, connection=c, serializer=JSONSerializer)", []),
    ("Worker.all(queue=q)", ["rq-without-json-serializer Worker.all"]),
])
def test_the_scan_catches_what_it_looks_for(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    assert [f"{kind} {what}" for kind, _, what in findings(path)] == expected


def assert_no_pickles(store, prefix: str) -> int:
    """No object under `prefix` is a pickle or a torch zip; every .safetensors object parses as one.
    Returns how many objects were checked."""
    from safetensors.torch import load

    keys = store.list(prefix)
    for key in keys:
        data = store.get_bytes(key)
        if key.endswith(".safetensors"):
            load(data)  # raises unless it is a safetensors file (whose header length may start with 0x80)
        else:
            assert not data.startswith(PICKLE_MAGIC), f"{key} is a pickle"
            assert b"PK\x03\x04" not in data[:1024], f"{key} holds a zip (torch.save) header"
    return len(keys)
