"""How many bytes an extraction will store, checked before any forward pass."""

from __future__ import annotations

import re

from eyrie.core.errors import EyrieError

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
FILE_OVERHEAD = 256  # safetensors header of one sample file
TOKEN_ID_BYTES = 8  # int64, as speculators reads input_ids


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise EyrieError(f"cannot read the size {text!r}.", "write it like 2.8TB, 500GB or 64GiB.")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def human(n: float) -> str:
    for unit in ("TB", "GB", "MB", "kB"):
        if n >= UNITS[unit.upper()]:
            return f"{n / UNITS[unit.upper()]:.2f} {unit}"
    return f"{n:.0f} B"


def bytes_per_token(n_states: int, hidden: int, dtype: str) -> float:
    """Stored bytes per token: the states, their fp8 scale, and the int64 token id."""
    states = n_states * hidden * (1 if dtype == "fp8" else 2)
    return states + (4 if dtype == "fp8" else 0) + TOKEN_ID_BYTES


def token_id_bytes(tokens: int, samples: int) -> int:
    """A sample stored without its hidden states (hybrid's rest, online): its token ids only."""
    return tokens * TOKEN_ID_BYTES + samples * FILE_OVERHEAD


def projected_bytes(tokens: int, samples: int, n_states: int, hidden: int, dtype: str) -> int:
    return int(tokens * bytes_per_token(n_states, hidden, dtype) + samples * FILE_OVERHEAD)


def samples_that_fit(limit: int, tokens_per_sample: int, n_states: int, hidden: int, dtype: str) -> int:
    """How many samples of this length the limit holds."""
    return int(limit // (tokens_per_sample * bytes_per_token(n_states, hidden, dtype) + FILE_OVERHEAD))


def length_that_fits(limit: int, samples: int, n_states: int, hidden: int, dtype: str) -> int:
    """The longest stored sample (tokens) at which this many samples fit the limit."""
    return max(0, int((limit / samples - FILE_OVERHEAD) // bytes_per_token(n_states, hidden, dtype)))


def check_fits(tokens: int, samples: int, n_states: int, hidden: int, dtype: str,
               budget: int | None, free: int | None) -> int:
    """The projection; refuses with both numbers and the options when it does not fit."""
    need = projected_bytes(tokens, samples, n_states, hidden, dtype)
    limit, what = (budget, "the budget (--budget)") if budget is not None else (free, "free space in the store")
    if limit is not None and need > limit:
        options = [f"fewer samples or a shorter --max-length (at most ~{int(limit / bytes_per_token(n_states, hidden, dtype)):,} tokens fit)"]
        if dtype != "fp8":
            fp8 = projected_bytes(tokens, samples, n_states, hidden, "fp8")
            options.insert(0, f"--dtype fp8 ({human(fp8)}{', fits' if fp8 <= limit else ', still too big'})")
        raise EyrieError(
            f"extraction needs {human(need)} ({tokens:,} tokens x {n_states} states x {hidden} x "
            f"{dtype}) but {what} is {human(limit)}.", "use " + "; or ".join(options) + ".")
    return need
