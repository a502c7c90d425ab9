"""Bad input through the real command line: every malformed dataset shape is either answered
with each row accounted for (done + skipped with its reason + failed == rows; exit 0) or refused
with one line naming the problem and the fix (exit 1); never a stack trace. And the CLI's
arguments fuzzed (hypothesis): exit 0, 1 or 2, never an unhandled exception."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.support.harness import ROOT, TINY, eyrie, eyrie_in_process, wait_http
from tests.support.processes import free_port, stop

GOOD = {"conversations": [{"from": "human", "value": "hello"}]}
HUGE = "word " * (1 << 20)  # a 5 MB message


def turn(value, role="human"):
    return {"conversations": [{"from": role, "value": value}]}


def jsonl(*rows):
    """Lines of a .jsonl file: a dict/list/None is JSON-encoded, bytes are written as they are."""
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def parquet(rows, schema=None):
    return lambda path: pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=2)


def truncated_parquet(path):
    parquet([GOOD] * 20)(path)
    path.write_bytes(path.read_bytes()[:-100])


def hf_dir(files: dict):
    """An HF-style dataset directory: {relative path: bytes or a writer of a path}."""
    def write(root):
        root.mkdir()
        for name, content in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            content((root / name)) if callable(content) else (root / name).write_bytes(content)
    return write


TURNS = pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))

# name, file name, content (bytes or a writer of the path), then either
# {"done": n, reason: n, ...} (exit 0, every row accounted for) or ("refused", words of the message)
CASES = [
    ("missing_field", "d.jsonl", jsonl(GOOD, {"text": "hi"}, {"conversation": GOOD["conversations"]}),
     {"done": 1, "no_conversation_field": 2}),
    ("conversation_number_dict_string", "d.jsonl",
     jsonl(GOOD, {"conversations": 3}, {"conversations": {"from": "human", "value": "hi"}}, {"messages": "hi"}),
     {"done": 1, "conversation_not_a_list": 3}),
    ("text_number_list_dict_bool", "d.jsonl",
     jsonl(GOOD, turn(7), turn(["a"]), turn({"a": 1}), turn(True),
           {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
     {"done": 1, "text_not_a_string": 5}),
    ("role_number_null_unknown", "d.jsonl",
     jsonl(GOOD, turn("hi", role=3), turn("hi", role=None), turn("hi", role="narrator"),
           {"messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "hi"}]}),
     {"done": 1, "unknown_role": 4}),
    ("turn_not_an_object", "d.jsonl", jsonl(GOOD, {"conversations": ["hi", 3]}, {"conversations": [None]}),
     {"done": 1, "turn_not_an_object": 2}),
    ("null_rows_and_null_content", "d.jsonl",
     jsonl(GOOD, None, turn(None), {"conversations": None}, {"messages": [{"role": "user", "content": None}]},
           {"conversations": None, "messages": [{"role": "user", "content": "null conversations, good messages"}]}),
     {"done": 2, "row_not_an_object": 1, "null_text": 2, "no_conversation_field": 1}),
    ("empty_and_blank_turns", "d.jsonl",
     jsonl(GOOD, {"conversations": []}, turn("   "), {"conversations": [{}]}, turn("only", role="gpt")),
     {"done": 1, "empty_conversation": 1, "empty_prompt": 1, "turn_without_role_or_text": 1, "no_human_turn": 1}),
    ("not_utf8", "d.jsonl", jsonl(GOOD, b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}', b"\xff\xfe\x00"),
     {"done": 1, "not_utf8": 2}),
    ("broken_line_among_good", "d.jsonl",
     jsonl(GOOD, GOOD, b'{"conversations": [{"from": "human", "value": "cut', GOOD, b"NaN", b"{'single': 1}"),
     {"done": 3, "invalid_json": 3}),
    ("blank_lines_among_good", "d.jsonl", jsonl(GOOD, b"", b"   \t", GOOD), {"done": 2, "empty_line": 2}),
    ("utf8_bom", "d.jsonl", b"\xef\xbb\xbf" + jsonl(GOOD, GOOD), {"done": 2}),
    ("crlf_and_no_final_newline", "d.jsonl", jsonl(GOOD).replace(b"\n", b"\r\n") + json.dumps(GOOD).encode(),
     {"done": 2}),
    ("huge_row", "d.jsonl", jsonl(GOOD, turn(HUGE)), {"done": 2}),
    ("deeply_nested_row", "d.jsonl", jsonl(GOOD, b"[" * 5000 + b"]" * 5000), {"done": 1, "invalid_json": 1}),
    ("empty_file", "d.jsonl", b"", ("refused", "has no rows")),
    ("only_whitespace", "d.jsonl", b"\n   \n\t\n", ("refused", "no", "usable prompt", "empty_line x3")),
    ("only_broken_rows", "d.jsonl", jsonl(b"{", None, {"text": "hi"}), ("refused", "usable prompt", "invalid_json")),
    ("json_array_not_lines", "d.json", json.dumps([GOOD, GOOD]).encode(),
     ("refused", "row_not_an_object", "JSON Lines")),
    ("csv_file", "d.csv", b"prompt,answer\nhi,there\n", ("refused", "invalid_json", "JSON Lines")),
    ("utf16_file", "d.jsonl", jsonl(GOOD, GOOD).decode().encode("utf-16"), ("refused", "usable prompt")),
    ("not_a_regular_file", "/dev/null", None, ("refused", "not a regular file")),
    ("name_too_long", "x" * 300 + ".jsonl", None, ("refused", "File name too long")),
    ("missing_file", "missing.jsonl", None, ("refused", "no such file", "missing.jsonl")),
    # parquet: typed columns, so a bad shape is a whole column, and nulls are per row
    ("parquet_missing_column", "d.parquet", parquet([{"text": "hi"}] * 3), ("refused", "no_conversation_field x3")),
    ("parquet_wrong_type", "d.parquet", parquet([{"conversations": 1}, {"conversations": 2}]),
     ("refused", "conversation_not_a_list")),
    ("parquet_string_column", "d.parquet", parquet([{"conversations": json.dumps(GOOD["conversations"])}]),
     ("refused", "conversation_not_a_list")),
    ("parquet_null_rows_and_values", "d.parquet",
     parquet([GOOD, {"conversations": None}, turn(None), turn("hi", role=None)],
             pa.schema([("conversations", TURNS)])),
     {"done": 1, "no_conversation_field": 1, "null_text": 1, "unknown_role": 1}),
    ("parquet_unknown_roles", "d.parquet", parquet([GOOD, turn("hi", role="narrator"), turn("hi", role="")]),
     {"done": 1, "unknown_role": 2}),
    ("parquet_mixed_turn_keys", "d.parquet",  # one column, both turn shapes: the missing keys are null
     parquet([GOOD, {"conversations": [{"role": "user", "content": "openai shape"}]},
              {"conversations": None, "messages": [{"role": "user", "content": "other column"}]}],
             pa.schema([("conversations", pa.list_(pa.struct([(k, pa.string()) for k in ("from", "value", "role",
                                                                                        "content")]))),
                        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])),
     {"done": 3}),
    ("parquet_huge_row", "d.parquet", parquet([GOOD, turn(HUGE)]), {"done": 2}),
    ("parquet_binary_text", "d.parquet",  # a `binary` column: UTF-8 bytes are text, other bytes skipped
     parquet([turn(b"utf-8 bytes"), turn("caf\u00e9".encode()), turn(b"\xff\xfe not text")],
             pa.schema([("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.binary())])))])),
     {"done": 2, "non_utf8_bytes": 1}),
    ("parquet_no_rows", "d.parquet", parquet([], pa.schema([("conversations", TURNS)])), ("refused", "has no rows")),
    ("parquet_truncated", "d.parquet", truncated_parquet, ("refused", "cannot be read", "truncated")),
    ("parquet_not_parquet", "d.parquet", b"PAR1 this is not parquet", ("refused", "cannot be read")),
    ("parquet_zero_bytes", "d.parquet", b"", ("refused", "cannot be read")),
    # HF-style directories (datasets.load_dataset)
    ("hf_dir_no_data_files", "ds", hf_dir({"README.md": b"# nothing", "data/notes.txt": b"x"}),
     ("refused", "does not look like a dataset directory")),
    ("hf_dir_truncated_parquet", "ds", hf_dir({"data/train-00000-of-00001.parquet": truncated_parquet}),
     ("refused", "cannot load dataset")),
    ("hf_dir_broken_jsonl", "ds", hf_dir({"data/train.jsonl": jsonl(GOOD, b"{broken", GOOD)}),
     ("refused", "cannot load dataset", "JSON parse error")),
    ("hf_dir_empty_file", "ds", hf_dir({"data/train.jsonl": b""}), ("refused", "only empty data files")),
    ("hf_dir_not_arrow", "ds", hf_dir({"data/train.arrow": b"\x00garbage" * 30}), ("refused", "Not an Arrow file")),
    ("hf_dir_no_train_split", "ds", hf_dir({"data/test.jsonl": jsonl(GOOD)}), ("refused", "split train")),
    ("hf_dir_bad_rows", "ds", hf_dir({"data/train.jsonl": jsonl(GOOD, {"conversations": [{"from": "narrator",
                                                                                       "value": "x"}]})}),
     {"done": 1, "unknown_role": 1}),
]


@pytest.fixture(scope="module")
def stub_url():
    """One vLLM stand-in for the module (starting one per case costs more than the case)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "stub_openai.py"), "--port", str(port),
                             "--tokens", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc=proc)
    yield url
    stop(proc)


def write_case(tmp_path: Path, name: str, content) -> str:
    if content is None:
        return name if name.startswith("/") else str(tmp_path / name)
    path = tmp_path / name
    content(path) if callable(content) else path.write_bytes(content)
    return str(path)


def no_traceback(*results):
    for result in results:
        assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
@pytest.mark.parametrize("case,filename,content,expected", CASES, ids=[c[0] for c in CASES])
def test_malformed_dataset_is_accounted_for_or_refused(env, stub_url, tmp_path, case, filename, content,
                                                       expected):
    env = {**env, "EYRIE_INFERENCE_URL": stub_url, "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY)}
    source = write_case(tmp_path, filename, content)
    started = eyrie_in_process("generate", "--dataset", source, "--run", "bad", "--shard-size", "3", env=env,
                               check=False)
    no_traceback(started)
    if isinstance(expected, tuple):
        assert started.returncode == 1, started
        lines = started.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("eyrie: error:") and " Fix: " in lines[0], started.stderr
        for words in expected[1:]:
            assert words in lines[0]
        return
    assert started.returncode == 0, started.stderr
    worker = eyrie("worker", "generate", "--burst", env=env, check=False)
    no_traceback(worker)
    assert worker.returncode == 0
    status = eyrie_in_process("status", "bad", "--json", env=env)
    gen = json.loads(status.stdout)["stages"]["generate"]
    rows = sum(expected.values())
    assert (gen["state"], gen["total"]) == ("done", rows)
    assert gen["done"] + gen["skipped"] + gen["failed"] == rows
    assert (gen["done"], gen["failed"]) == (expected["done"], 0)
    assert gen["skip_reasons"] == {k: n for k, n in expected.items() if k != "done"}


# --- the CLI's arguments, fuzzed -------------------------------------------------------------

NASTY = st.sampled_from(["", " ", "-1", "0", "1", "-0", "1e400", "-1e400", "nan", "inf", "-inf", "2**70",
                         str(2**64), str(-2**63), "99999999999999999999999", "../x", "a/b", "x" * 300,
                         "é", "\u202e", "--", "-", "--help", "fz", "fz/../fz", "/dev/null", "/", ".", "~"])
TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=20)
KINDS = {
    "int": st.one_of(st.integers(-2**70, 2**70).map(str), NASTY),
    "float": st.one_of(st.floats().map(repr), NASTY),
    "text": st.one_of(TEXT, NASTY),
    "run": st.one_of(st.just("fz"), st.just("fz"), st.just("fz"),  # the run that exists, half of the time
                     st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True), TEXT, NASTY),
}
# per subcommand: required options (a positional run is "RUN"), optional ones with their kind;
# options that block (--wait) left out
COMMANDS = {
    "generate": (["--dataset", "--run"], {"--split": "text", "--revision": "text", "--limit": "int",
                                          "--concurrency": "int", "--max-tokens": "int", "--timeout": "float",
                                          "--temperature": "float", "--shard-size": "int"}),
    "extract": (["--run"], {"--layers": "text", "--dtype": "text", "--max-length": "int", "--budget": "text",
                            "--backend": "text"}),
    "train": (["--run"], {"--base-revision": "text", "--epochs": "int", "--max-steps": "int",
                          "--draft-vocab": "int", "--lr": "float", "--seq-len": "int", "--ttt-steps": "int",
                          "--heldout": "int"}),
    "status": (["RUN"], {"--json": None}), "show": (["RUN"], {"--json": None}), "cancel": (["RUN"], {}),
    "retry": (["RUN"], {}), "logs": (["RUN"], {"--limit": "int", "--json": None}),
    "run": (["--config"], {"--plan": None}),
}
USAGE_MISTAKES = st.sampled_from([[]] * 16 + [["--bogus"], ["-x", "1"], ["stray"], ["--run"]])


@st.composite
def command_lines(draw, files: dict):
    """Mostly well-formed command lines with bad values; now and then a usage mistake."""
    command = draw(st.sampled_from(sorted(COMMANDS)))
    required, optional = COMMANDS[command]
    args = [command]
    for name in required:
        if name == "RUN":
            args.append(draw(KINDS["run"]))
        elif name in ("--dataset", "--config"):
            args += [name, draw(st.one_of(st.sampled_from(sorted(files.values())), KINDS["text"]))]
        else:
            args += [name, draw(KINDS["run"])]
    for name in draw(st.lists(st.sampled_from(sorted(optional) or ["--bogus"]), max_size=3, unique=True)):
        kind = optional.get(name, "text")
        args += [name] if name in optional and kind is None else [name, draw(KINDS[kind])]
    if command == "run" and "--plan" not in args and draw(st.integers(0, 3)):
        args.append("--plan")  # mostly the projection; a real start is refused or continues run fz
    return args + draw(USAGE_MISTAKES)


def config_files(tmp_path: Path, dataset: Path) -> dict:
    """run.yaml files for `eyrie run --config`: good, and with bad values in each section."""
    good = {"run": "fz", "target": {"model": str(TINY)}, "dataset": {"source": str(dataset)}}
    variants = {
        "good": good,
        "big": {**good, "generate": {"concurrency": 2**70, "max_tokens": -1}, "train": {"lr": float("inf")}},
        "types": {**good, "dataset": {"source": 3, "limit": "many"}, "extract": {"layers": "2,3", "dtype": "fp4"}},
        "extra": {**good, "generate": {"concurency": 8}, "nope": 1},
        "shape": {**good, "target": {"model": "nobody/nothing", "shape": {"hidden_size": 0}}},
        "list": [good], "scalar": "run: fz",
    }
    files = {name: tmp_path / f"{name}.yaml" for name in variants}
    for name, value in variants.items():
        files[name].write_text(json.dumps(value).replace("Infinity", ".inf"))  # JSON is YAML
    files["broken"] = tmp_path / "broken.yaml"
    files["broken"].write_text("run: [fz\n  target: {")
    files["deep"] = tmp_path / "deep.yaml"
    files["deep"].write_text("run: " + "[" * 5000 + "]" * 5000)
    files["binary"] = tmp_path / "binary.yaml"
    files["binary"].write_bytes(b"\xff\xfe\x00run")
    return {**{k: str(v) for k, v in files.items()}, "dir": str(tmp_path), "data": str(dataset)}


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_cli_arguments_fuzzed_exit_0_1_or_2_never_a_traceback(env, stub_url, tmp_path, monkeypatch):
    """In-process (typer's CliRunner on eyrie.commands.cli.app, milliseconds a call) against real Redis and
    a real store, with a run `fz` whose generate stage is done, so extract gets past the run."""
    from eyrie.commands.cli import app

    env = {**env, "EYRIE_INFERENCE_URL": stub_url, "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY)}
    data = tmp_path / "d.jsonl"
    data.write_bytes(jsonl(GOOD, GOOD, {"text": "skipped"}))
    eyrie("generate", "--dataset", str(data), "--run", "fz", env=env)
    eyrie("worker", "generate", "--burst", env=env)
    files = config_files(tmp_path, data)
    for key in ("EYRIE_INFERENCE_URL", "EYRIE_SERVER", "EYRIE_MODEL"):
        monkeypatch.setenv(key, env[key])
    runner = CliRunner()

    @settings(max_examples=80, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(command_lines(files))
    def check(args):
        result = runner.invoke(app, args, catch_exceptions=True)
        unexpected = result.exception if not isinstance(result.exception, SystemExit) else None
        assert unexpected is None, f"eyrie {args!r} raised {unexpected!r}\n{result.output}"
        assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output)
        assert "Traceback" not in result.output, (args, result.output)
        assert "internal error" not in result.output, (args, result.output)  # our catch-all: still a bug

    check()


BIG = str(2**70)
REGRESSIONS = [  # command lines that once ended in a traceback (or stored inf as null); words of the error now
    (["generate", "--dataset", "{data}", "--run", "n1", "--concurrency", BIG], "--concurrency"),
    (["generate", "--dataset", "{data}", "--run", "n1", "--max-tokens", BIG, "--shard-size", BIG], "--shard-size"),
    (["generate", "--dataset", "{data}", "--run", "n1", "--timeout", "inf", "--temperature", "1e400"], "finite"),
    (["generate", "--dataset", "x" * 300, "--run", "n1"], "File name too long"),
    (["generate", "--dataset", "/dev/null", "--run", "n1"], "not a regular file"),
    (["extract", "--run", "n1", "--max-length", BIG], "--max-length"),
    (["train", "--run", "n1", "--epochs", BIG, "--lr", "inf"], "--lr inf"),
    (["run", "--config", "{dir}", "--plan"], "Is a directory"),
    (["run", "--config", "x" * 300, "--plan"], "File name too long"),
    (["run", "--config", "{binary}", "--plan"], "cannot read config"),
    (["run", "--config", "{broken}", "--plan"], "not valid YAML"),
    (["run", "--config", "{deep}", "--plan"], "maximum recursion depth"),
    (["run", "--config", "{big}", "--plan"], "finite number"),
]


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
@pytest.mark.parametrize("args,words", REGRESSIONS, ids=[" ".join(a)[:40] for a, _ in REGRESSIONS])
def test_bad_argument_values_are_one_line_errors(env, tmp_path, args, words):
    from eyrie.commands.cli import app

    data = tmp_path / "d.jsonl"
    data.write_bytes(jsonl(GOOD))
    files = config_files(tmp_path, data)
    result = CliRunner().invoke(app, [a.format(**files) if a.startswith("{") else a for a in args])
    assert result.exit_code == 1 and not isinstance(result.exception, Exception), (result.exception, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eyrie: error:") and " Fix: " in lines[0], result.stderr
    assert words in lines[0]
