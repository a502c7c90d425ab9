"""README as a newcomer runs it (issue 29 item 12), cheaply: every command of its ```bash blocks
exists as written, without running the long ones. `make` targets and the variables they are given;
`eyrie` subcommands, their options, choices and arguments (read from the CLI's own click tree, no
process); the run configs they name planned with `--plan` (in process); the run names they use are
runs those configs (or the commands before them) make; EYRIE_* names are settings or read by the
Makefile, scripts or Compose files; the sed recipe runs as written; a block that starts services
in the background starts its Redis first. Beside the blocks: the stage list names every stage, and
the suite's duration is docs/testing.md's, not a figure of README's own that goes stale."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest
import yaml
from typer.main import get_command

from eyrie.commands.cli import app
from eyrie.core.config import Settings
from eyrie.stages import PIPELINE, queues
from eyrie_trainer.benchmarks import BENCHMARKS
from tests.support.harness import OFFLINE, ROOT, eyrie_in_process

README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
EYRIE = ("eyrie", ".venv/bin/eyrie")
NOT_OURS = ("vllm", "cp", "export", "sed", "curl", "docker", "kubectl", "helm", "hf", "tensorboard", "mc")  # checked below where they
# name our files, else left to their own docs
OPERATORS = (";", "&", "&&", "|", "||")
REDIS_FREE = ("--plan", "--help")  # eyrie commands that reach no Redis with these


def blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, re.S)


def commands(block: str) -> list[tuple[list[str], bool]]:
    """Each simple command of a block as words, and whether it runs in the background (`&`);
    `for X in A B; do CMD $X & done` is one command per value."""
    block = re.sub(r"for (\w+) in ([^;]+); do (.+?) done",
                   lambda m: "\n".join(m.group(3).replace("$" + m.group(1), v) for v in m.group(2).split()), block)
    found = []
    for line in block.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        current: list[str] = []
        for word in [*lexer, ";"]:
            if word in OPERATORS:
                if current:
                    found.append((current, word == "&"))
                current = []
            else:
                current.append(word)
    return found


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def known_variable(name: str) -> bool:
    """An EYRIE_* setting, or a variable the Makefile, a script or a Compose file reads."""
    if name.startswith("EYRIE_") and name[len("EYRIE_"):].lower() in Settings.model_fields:
        return True
    places = [MAKEFILE, *(p.read_text() for p in (ROOT / "scripts").glob("*.sh")),
              *(p.read_text() for p in ROOT.glob("*compose*.yml")), (ROOT / ".env.example").read_text()]
    return any(re.search(rf"\b{name}\b", text) for text in places)


class Readme:
    """What the blocks' commands name, checked as they come (a run made by one command is known to the next)."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.cli = get_command(app)
        self.configs: dict[str, str] = {}  # as README names it -> the file here
        self.runs = {"demo"}  # `make demo` runs `eyrie demo`, whose run is demo
        for path in (ROOT / "examples").glob("*.yaml"):
            self.runs.add(yaml.safe_load(path.read_text())["run"])
        self.planned: set[str] = set()

    def check(self, words: list[str]) -> None:
        env, words = split_env(list(words))
        unknown = [name for name in env if not known_variable(name)]
        assert not unknown, f"{unknown} set in README but read nowhere"
        if not words:
            return
        program, *rest = words
        if program in EYRIE:
            self.eyrie(rest)
        elif program == "make":
            self.make(rest)
        elif program == "sed":
            self.sed(rest)
        elif program == "cp":
            assert (ROOT / rest[0]).exists(), rest
        elif program == ".venv/bin/python":
            self.python(rest)
        elif program == "export":
            self.check(rest)
        else:
            assert program in NOT_OURS, f"README runs {program}: add it to NOT_OURS if it is not ours"

    def python(self, words: list[str]) -> None:
        """A script of ours: it exists, and each --option given is one it declares."""
        script = (ROOT / words[0]).read_text()
        unknown = [w for w in words[1:] if re.fullmatch(r"--[a-z-]+", w) and f'"{w}"' not in script]
        assert not unknown, f"{words[0]} has no option {unknown}"
        if "--config" in words:  # a script that runs a config (bench/real_model.py) makes its run
            self.runs.add(yaml.safe_load((ROOT / words[words.index("--config") + 1]).read_text())["run"])

    def make(self, words: list[str]) -> None:
        for word in words:
            if "=" in word:
                name, _, value = word.partition("=")
                assert f"$({name})" in MAKEFILE, f"make is given {name}, which the Makefile never reads"
                if name == "CONFIG":
                    self.config(value)
                if name == "RUN":
                    self.run_name(value)
            else:
                assert re.search(rf"^{re.escape(word)}:", MAKEFILE, re.M), f"no make target {word}"

    def eyrie(self, words: list[str]) -> None:
        name, *rest = words
        command = self.cli.commands.get(name)
        assert command is not None, f"no command `eyrie {name}`"
        options = {opt: p for p in command.params if p.param_type_name == "option"
                   for opt in (*p.opts, *p.secondary_opts)}
        arguments = [p for p in command.params if p.param_type_name == "argument"]
        given, positional, words = {}, [], list(rest)
        while words:
            word = words.pop(0).strip("[]")
            if not word.startswith("--"):
                positional.append(word)
                continue
            opt, _, value = word.partition("=")
            assert opt in options, f"`eyrie {name}` has no option {opt}"
            if not options[opt].is_flag and not value:
                value = words.pop(0).strip("[]")
            choices = getattr(getattr(options[opt], "type", None), "choices", None)
            assert not choices or value in choices, (name, opt, value)
            given[opt] = value
        assert len(positional) <= sum(a.nargs if a.nargs > 0 else len(positional) for a in arguments), \
            f"`eyrie {name}` takes {len(arguments)} arguments: {positional}"
        if name == "worker":
            assert positional[0] in queues(), positional
        if name in ("status", "watch", "show", "cancel", "retry", "logs") and positional:
            self.run_name(positional[0])
        if "--run" in given:
            self.run_name(given["--run"])
        if "--as" in given:
            self.runs.add(given["--as"])
        for bench in filter(None, given.get("--bench", "").split(",")):
            assert bench in BENCHMARKS, bench
        if "--config" in given and name in ("run", "serve"):
            self.config(given["--config"])

    def config(self, named: str) -> None:
        """A run config README names: it exists (or an earlier command wrote it) and plans."""
        path = self.configs.get(named, str(ROOT / named))
        assert (ROOT / path).is_file(), f"no run config {named}"
        if path not in self.planned:  # --plan in process: the config, its target's shape and dataset
            done = eyrie_in_process("run", "--config", path, "--plan", env=self.env, check=False)
            assert done.returncode == 0, f"eyrie run --config {named} --plan:\n{done.stdout}{done.stderr}"
            self.planned.add(path)
        self.runs.add(yaml.safe_load((ROOT / path).read_text())["run"])

    def run_name(self, name: str) -> None:
        assert name.isupper() or name in self.runs, f"README uses run {name}, which no config or command before makes"

    def sed(self, words: list[str]) -> None:
        """The recipe as written, its output where README puts it mapped to the test's directory;
        each expression changes a line of its input (else the input changed and the recipe is stale)."""
        *args, source, redirect, target = words
        assert redirect == ">", words
        expressions = [args[i + 1] for i, a in enumerate(args) if a == "-e"]
        text = (ROOT / source).read_text()
        for expression in expressions:
            one = subprocess.run(["sed", "-e", expression, source], cwd=ROOT, capture_output=True, text=True, check=True)
            assert one.stdout != text, f"sed -e {expression!r} changes nothing in {source}: README's recipe is stale"
        out = self.tmp_path / re.sub(r"\W", "_", target)
        out.write_text(subprocess.run(["sed", *args, source], cwd=ROOT, capture_output=True, text=True,
                                      check=True).stdout)
        self.configs[target] = str(out)

    @property
    def env(self) -> dict:
        import os

        return {**os.environ, **OFFLINE, "EYRIE_STORE_URL": f"file://{self.tmp_path / 'store'}"}


def test_every_readme_command_exists_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # README's paths are the repository's
    readme = Readme(tmp_path)
    for block in blocks():
        for words, _ in commands(block):
            readme.check(words)
    assert readme.planned  # the check reached the configs


def test_a_block_that_starts_services_starts_redis_first():
    """`eyrie serve` and the workers read and write Redis: a block that starts them in the
    background (the real-model section) first starts one (`make redis-up`: EYRIE_REDIS_URL, started
    with AOF in .eyrie/redis unless one answers there), as `make demo` does."""
    for block in blocks():
        started = False
        for words, background in commands(block):
            _, words = split_env(list(words))
            if not words:
                continue
            started = started or (words[0] == "make" and bool({"redis-up", "demo"} & set(words[1:])))
            if background and words[0] in EYRIE:
                assert started, f"README starts `{' '.join(words)}` before any Redis:\n{block}"
    assert re.search(r"^redis-up:", MAKEFILE, re.M)


def test_a_bare_eyrie_comes_after_readme_says_how_to_have_it():
    """`eyrie` is on no PATH after `make setup` (`.venv/bin/eyrie` is): README says how first."""
    first = min(README.index(block) for block in blocks() if any(w[0] == "eyrie" for w, _ in commands(block)))
    assert ". .venv/bin/activate" in README[:first]


def test_the_stage_list_and_the_test_time():
    status = re.search(r"Status of the stages:(.*?)\n\n", README, re.S).group(1)
    assert all(f"**{stage.name}**" in status for stage in PIPELINE if stage.shown), status
    intro = README[:README.index("## A real model")]
    assert "docs/testing.md" in intro
    assert not re.search(r"\d+ min of pytest|\d+(\.\d+)? times faster", intro), \
        "README's own figure for the suite goes stale: point to docs/testing.md"


@pytest.mark.parametrize("line", ["for q in generate extract; do eyrie worker $q & done"])
def test_a_loop_is_one_command_per_value(line):
    assert commands(line) == [(["eyrie", "worker", "generate"], True), (["eyrie", "worker", "extract"], True)]


def test_the_example_card_readme_points_to_parses_as_a_hub_model_card():
    """docs/examples/smollm2-general-2k-1ep/README.md (what `eyrie publish` wrote for the SmolLM2 run):
    huggingface_hub's own card class reads its metadata, the results name vLLM's acceptance per set, and
    the card says how to serve it and what --force overrode."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(ROOT / "docs/examples/smollm2-general-2k-1ep/README.md")
    assert card.data.library_name == "speculators" and "eagle3" in card.data.tags
    sets = {r.dataset_name for r in card.data.eval_results if r.metric_name.startswith("vLLM mean acceptance")}
    assert {"heldout", "mt-bench", "humaneval", "gsm8k"} <= sets, sets
    assert "vllm serve " in card.text and "Published with `--force`" in card.text
    assert "docs/examples/smollm2-general-2k-1ep" in README
