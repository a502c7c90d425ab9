"""What a target's identity costs (issue 49 item 1): eyrie.core.file_hashes.file_sha256 on one large
file, in a temporary directory. Four figures: sha256 of a buffer in memory (the CPU's ceiling); the
first look (the file just written, so in the page cache here: the hash's own rate, nothing dropped);
a read after posix_fadvise(DONTNEED) asked the kernel to drop the file's pages (closer to a checkpoint
that is not in memory, where the disk is the slower of the two); the second look (the cache: a stat
and one sqlite lookup). Writes bench/results/hash_speed.json and its section of bench/RESULTS.md,
with the extrapolation to 1T-parameter checkpoints. No absolute path is written anywhere.

  .venv/bin/python bench/hash_speed.py              # 2 GB
  .venv/bin/python bench/hash_speed.py --size 256MB --no-write"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import ssl
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from results import write_section

from eyrie.core.budget import human, parse_size
from eyrie.core.file_hashes import RACY_NS, HashCache, counts, file_sha256, stream_sha256

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "hash_speed.json"
RESULTS = ROOT / "bench" / "RESULTS.md"
BLOCK = 64 << 20
CHECKPOINTS = {"1T parameters, bf16 (~2 TB)": 2 * 10**12, "1T parameters, FP8 (~1 TB)": 10**12,
               "1T parameters, INT4 (~0.6 TB)": 6 * 10**11}


def machine() -> dict:
    """lscpu's model name and the cores, whether the CPU has the SHA extensions, the versions."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"cpu": fields.get("Model name", platform.processor() or "unknown").strip(), "cores": os.cpu_count(),
            "sha_extensions": "sha_ni" in flags, "python": platform.python_version(), "openssl": ssl.OPENSSL_VERSION,
            "kernel": platform.release()}


def write_file(path: Path, size: int) -> None:
    """`size` bytes of one random block repeated (sha256's speed does not depend on the bytes), synced."""
    block = os.urandom(BLOCK)
    with open(path, "wb") as f:
        for start in range(0, size, BLOCK):
            f.write(block[: min(BLOCK, size - start)])
        f.flush()
        os.fsync(f.fileno())


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def in_memory_rate(size: int = 512 << 20) -> float:
    data = memoryview(os.urandom(BLOCK))
    seconds, _ = timed(lambda: [hashlib.sha256(data).digest() for _ in range(size // BLOCK)])
    return size / seconds


def evicted_read(path: Path) -> tuple[float, str]:
    """The file hashed again once its pages were dropped (an unchanged file's pages go at once; what the
    device, or a host cache under a VM's disk, gives back is what this measures)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return timed(lambda: stream_sha256(path))


def one_round(path: Path, cache_path: Path) -> dict[str, float]:
    """Seconds of each look at the file, with a new cache."""
    cache_path.unlink(missing_ok=True)
    with HashCache(cache_path) as cache:
        first_s, digest = timed(lambda: file_sha256(path, cache))
        hits = counts["cache_hits"]
        second_s, again = timed(lambda: file_sha256(path, cache))
        assert again == digest and counts["cache_hits"] == hits + 1, "the second look was not a cache hit"
    dropped_s, third = evicted_read(path)
    assert third == digest
    return {"first_look": first_s, "after_dropping_pages": dropped_s, "second_look": second_s}


def measure(size: int, parent: str | None, repeat: int) -> dict:
    """The median of `repeat` rounds (and their range) of each look."""
    with tempfile.TemporaryDirectory(prefix="eyrie-hash-speed-", dir=parent) as tmp:
        path, cache_path = Path(tmp) / "model.safetensors", Path(tmp) / "file-hashes.sqlite"
        write_file(path, size)
        time.sleep(max(0.0, (os.stat(path).st_mtime_ns + RACY_NS - time.time_ns()) / 1e9) + 0.1)
        rounds = [one_round(path, cache_path) for _ in range(repeat)]
        filesystem = _filesystem(tmp)
    result = {"size_bytes": size, "filesystem": filesystem, "rounds": repeat, "load_average_1min": os.getloadavg()[0],
              "in_memory_bytes_per_s": round(in_memory_rate())}
    for look in ("first_look", "after_dropping_pages"):
        seconds = sorted(r[look] for r in rounds)
        median = statistics.median(seconds)
        result[look] = {"seconds": round(median, 3), "bytes_per_s": round(size / median),
                        "bytes_per_s_range": [round(size / seconds[-1]), round(size / seconds[0])]}
    result["second_look"] = {"seconds": round(statistics.median(r["second_look"] for r in rounds), 6),
                             "what": "a stat and one sqlite lookup"}
    return result


def _filesystem(path: str) -> str:
    try:
        out = subprocess.run(["df", "--output=fstype", path], capture_output=True, text=True, check=True).stdout
        return out.split()[-1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def extrapolate(result: dict) -> dict:
    """Each checkpoint's first look at the page-cache rate and at the rate after dropping pages."""
    rates = {"first_look": result["first_look"]["bytes_per_s"],
             "after_dropping_pages": result["after_dropping_pages"]["bytes_per_s"]}
    return {name: {k: round(size / rate / 60, 1) for k, rate in rates.items()} | {"bytes": size}
            for name, size in CHECKPOINTS.items()}


def section(r: dict) -> list[str]:
    m, first, dropped = r["machine"], r["first_look"], r["after_dropping_pages"]
    sha = "with" if m["sha_extensions"] else "without"
    lines = ["# Target identity: hashing cost (bench/hash_speed.py)", "",
             f"- Machine: {m['cpu']}, {m['cores']} cores ({sha} the SHA extensions), Python {m['python']}, "
             f"{m['openssl']}, Linux {m['kernel']}; the file on {r['filesystem']}. Date: {r['date']}; load average "
             f"{r['load_average_1min']:.2f} after the rounds (the machine is shared).",
             f"- Command: `{r['command']}`: one {human(r['size_bytes'])} file, eyrie.core.file_hashes.file_sha256 "
             f"(sha256 in 4 MiB reads, one core); the medians of {r['rounds']} rounds (their range in brackets), "
             "each with a new cache.", "",
             "| look | seconds | rate |", "|---|---|---|",
             f"| sha256 of a buffer in memory (the CPU's ceiling) | | {human(r['in_memory_bytes_per_s'])}/s |",
             f"| first look (the file just written: in the page cache) | {first['seconds']:.2f} | "
             f"{_rate(first)} |",
             f"| read again after posix_fadvise(DONTNEED) dropped its pages | {dropped['seconds']:.2f} | "
             f"{_rate(dropped)} |",
             f"| second look (cached: a stat and one sqlite lookup) | {r['second_look']['seconds'] * 1e3:.2f} ms | |",
             "", "A first look at a 1T-parameter checkpoint at these rates (minutes; the slower of the hash and "
             "the disk holds, and a checkpoint that size is never in the page cache):", "",
             "| checkpoint | at the first look's rate | at the rate after dropping pages |", "|---|---|---|"]
    lines += [f"| {name} | {e['first_look']:,.1f} min | {e['after_dropping_pages']:,.1f} min |"
              for name, e in r["extrapolation"].items()]
    slower = dropped["bytes_per_s"] < 0.9 * first["bytes_per_s"]
    lines += ["", "Here the disk was the limit once the pages were dropped." if slower else
              "The read after dropping the pages was no slower: the hash, not this disk (or the cache of the host "
              "under this VM), was the limit here; on slower storage the disk's rate holds."]
    lines += ["", "eyrie.core.file_hashes.HASH_BYTES_PER_S (what `eyrie run --plan` projects a local target's first "
              "look at) is the first look's rate, rounded down. Every later look at an unchanged file is a stat: "
              "a target is hashed once per host (per hash cache: $XDG_CACHE_HOME/eyrie/file-hashes.sqlite)."]
    return lines


def _rate(look: dict) -> str:
    low, high = look["bytes_per_s_range"]
    return f"{human(look['bytes_per_s'])}/s ({low / 1e9:.2f}-{high / 1e9:.2f} GB/s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GB", help="the file's size (2GB, 512MiB, ...)")
    parser.add_argument("--dir", default=None, help="where the temporary directory goes (default: the system's)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the medians are reported")
    parser.add_argument("--no-write", action="store_true", help="print only: no JSON, no RESULTS.md section")
    args = parser.parse_args()
    result = {"machine": machine(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": f"python bench/hash_speed.py --size {args.size} --repeat {args.repeat}",
              **measure(parse_size(args.size), args.dir, args.repeat)}
    result["extrapolation"] = extrapolate(result)
    print(json.dumps(result, indent=1))
    if not args.no_write:
        OUT.write_text(json.dumps(result, indent=1) + "\n")
        write_section(RESULTS, section(result))
        print(f"wrote {OUT.relative_to(ROOT)} and its section of {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
