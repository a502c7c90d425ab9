"""bench/gpu_checks.py, the one command a session lent a GPU runs first, in its dry mode on the CPU:
it says what it would measure, fits the 10-minute budget (one call of the lent machine), and every script takes the flags it is
given (a renamed flag breaks this test, not the GPU session's scarce minutes)."""

import json
import subprocess
import sys

from tests.support.harness import ROOT


def test_the_gpu_script_says_what_it_would_measure_and_its_flags_exist():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_checks.py"), "--dry-run", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"extract", "train", "train-fast-path", "verify", "memory"}
    assert report["budget_s"] <= report["limit_s"] == 600  # one 10-minute command on the lent H200
    for name in ("extract", "train", "train-fast-path", "memory"):
        assert checks[name]["status"] == "ready", checks[name]
    assert "--shape 8b --device cuda" in checks["extract"]["command"] and "bare" in checks["extract"]["measures"]
    assert "--fast-path on" in checks["train-fast-path"]["command"]
    assert "speculators' own `train`" in checks["train"]["measures"]
    assert checks["verify"]["command"].split()[1] == "verify"
    assert checks["verify"]["status"] in ("ready", "missing: `eyrie verify` is not in this build (issue 11)")
    assert "memory.used" in checks["memory"]["measures"]


def test_a_flag_a_script_does_not_take_is_caught(monkeypatch):
    import gpu_checks

    check = dict(gpu_checks.plan()[0])
    check["argv"] = check["argv"] + ["--no-such-flag"]
    assert gpu_checks._ready(check) == "broken: extract_throughput.py has no --no-such-flag"
