"""What `eyrie run --plan` reads where the run config does not say it: the dataset's rows (how many,
and the mean sample length from the rows themselves) and the memory of this host's GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from statistics import fmean

from eyrie.core.budget import parse_size
from eyrie.core.errors import EyrieError
from eyrie.core.target import load_tokenizer
from eyrie.data import answers_set
from eyrie.data.dataset import iter_rows, looks_like_path, resolve
from eyrie.data.manifest import DatasetRef
from eyrie.data.prompts import Skip, to_prompt, to_row, to_turns
from eyrie.stages.start_checks import usable_row

SAMPLE_ROWS = 1000  # the mean is estimated from the dataset's first rows, at most this many
CHARS_PER_TOKEN = 4  # where the target's tokenizer is not on this host (English text: about 4)
ASSUMED_GPU_MEMORY = "141GB"  # an H200's, where neither the config nor a GPU of this host says


def dataset_rows(config, missing_ok: bool = False) -> tuple[int, DatasetRef | None]:
    """The rows the run will use, and the dataset where this host has it. A name that is not here
    is a missing file where it looks like a path (`./x`, `x.jsonl`, `a/b/c`: resolve says where it
    looked), else a hub id, which --plan does not download: its rows are dataset.limit.
    `missing_ok`: a started run's plan on another host (the file is where the run started).
    A published answers set on the hub is downloaded (a few megabytes): its rows are its answers. A
    dataset here without one usable prompt row is refused as generate refuses it (the one row contract)."""
    d = config.dataset
    published = None if Path(d.source).exists() or looks_like_path(d.source) else answers_set.find(d.source, d.revision)
    source = str(published.path) if published else d.source
    if Path(source).exists() or (looks_like_path(source) and not missing_ok):
        ref = resolve(source, d.split, d.revision if published is None else None, d.limit)
        if published is None and answers_set.find(source, d.revision) is None:  # prompts, not published answers
            usable_row(ref)
        return ref.row_end, ref
    if d.limit is None:
        raise EyrieError(f"dataset {d.source} is not a file or directory in {Path.cwd()}, so it is taken as a "
                         "Hugging Face hub dataset id, whose rows --plan cannot count without downloading it.",
                         "set dataset.limit in the run config (the rows the run will use), or give the path of "
                         "a local dataset.")
    return d.limit, None


def published_answers(config) -> str | None:
    """Where the run's answers come from where its dataset is a published answers set (eyrie.runs.from_answers)."""
    found = answers_set.find(config.dataset.source, config.dataset.revision)
    return found.where if found else None


def estimated_mean(config, ref: DatasetRef, max_tokens: int) -> tuple[int, str] | None:
    """The mean sample (prompt + answer) in tokens from the dataset's first rows: the prompts as
    they are, the answers at the rows' own answers' length where most rows have one (another
    model's answers: a guide), else at max_tokens. None where no row has a prompt."""
    read = ref.model_copy(update={"row_end": min(ref.row_end, ref.row_start + SAMPLE_ROWS)})
    pairs = [pair for _, row, _ in iter_rows(read) if (pair := _prompt_and_answer(row))]
    if not pairs:
        return None
    count, counted = _counter(config)
    prompt = fmean(count(p) for p, _ in pairs)
    answers = [count(a) for _, a in pairs if a]
    if len(answers) >= len(pairs) / 2:
        answer = min(max_tokens, fmean(answers))
        answered = f"answers {answer:,.0f} (the rows' own, capped at max_tokens)"
    else:
        answer, answered = max_tokens, f"answers at max_tokens {max_tokens:,} (the rows have none)"
    rows = f"the dataset's {ref.row_end - ref.row_start:,} rows" if len(pairs) == ref.row_end - ref.row_start \
        else f"{len(pairs):,} of the dataset's first rows"
    return round(prompt + answer), f"estimated from {rows}: prompts {prompt:,.0f} tokens ({counted}) + {answered}"


def requests(rows: int, ref: DatasetRef | None, turns: str) -> dict:
    """What generating costs in requests (`generate.turns`: all asks each user turn), counted on the
    dataset's first rows where it is here."""
    every = "one per user turn" if turns == "all" else "one per row"
    per_row = None
    if ref is not None:
        read = ref.model_copy(update={"row_end": min(ref.row_end, ref.row_start + SAMPLE_ROWS)})
        counts = [len(asked) for _, row, problem in iter_rows(read)
                  if not problem and not isinstance(asked := to_turns(row, turns), Skip)]
        per_row = fmean(counts) if counts else None
    total = None if per_row is None else round(rows * per_row)
    said = f"~{total:,} requests ({per_row:.2f} a row, {every})" if per_row else f"{every}"
    return {"turns": turns, "per_row": per_row, "requests": total, "statement": f"generate.turns {turns}: {said}"}


def _prompt_and_answer(row) -> tuple[str, str] | None:
    """The text up to the last human turn, and the answer turns after it (the row read as generate reads it:
    eyrie.data.prompts); None for a row generate skips."""
    read, prompt = to_row(row), to_prompt(row)
    if isinstance(prompt, Skip):
        return None
    answers = read.conversation[len(prompt):]
    return ("\n".join(m["content"] for m in prompt),
            "\n".join(m["content"] for m in answers if m["role"] == "assistant"))


def _counter(config):
    """Tokens in a text: the target's tokenizer where it is a local directory, else characters / 4."""
    if Path(config.target.model).is_dir():
        try:
            tokenizer = load_tokenizer(config.target.model, config.serve.trust_remote_code)
            return (lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])), "the target's tokenizer"
        except (EyrieError, ImportError):  # no transformers in this image (the API's, the generator's)
            pass
    return (lambda text: len(text) / CHARS_PER_TOKEN), \
        f"{CHARS_PER_TOKEN} characters a token: the target's tokenizer is not on this host"


def gpu_memory(config) -> tuple[int, str]:
    """One GPU's memory: plan.gpu_memory, else this host's GPU (the smallest, where it has several),
    else an H200's, said to be assumed."""
    if config.plan.gpu_memory:
        return parse_size(config.plan.gpu_memory), "plan.gpu_memory"
    device = device_memory()
    if device:
        return device, "this host's GPU (nvidia-smi)"
    return parse_size(ASSUMED_GPU_MEMORY), "assumed: an H200's; set plan.gpu_memory"


def device_memory() -> int | None:
    """The smallest GPU's memory on this host in bytes, as nvidia-smi reports it (None: no GPU here)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    mib = [int(v) for v in out.stdout.split() if v.isdigit()]
    return min(mib) * 2**20 if out.returncode == 0 and mib else None
