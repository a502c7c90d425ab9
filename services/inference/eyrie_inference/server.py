"""`eyrie serve`: start the target's OpenAI server, wait until it answers, publish it in Redis."""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis
import requests

from eyrie.core.config import Settings, load_settings
from eyrie.core.errors import EyrieError
from eyrie.core.run_config import ServeSection
from eyrie.core.target import describe
from eyrie.core.vllm import serve_argv, serve_env, start_server, stop_server, with_cpu_dtype
from eyrie.data.store import open_store
from eyrie.runs import serve_turns
from eyrie.runs.pipeline import can_go_on, drained_run, run_view
from eyrie.stages import PIPELINE
from eyrie.stages.run_config import load_config
from eyrie.stages.run_config import stored_config
from eyrie.tasks.gpu_admission import gpu_lease
from eyrie.work import inference
from eyrie.work.cancel import STOP_REQUESTED, stop_requested
from eyrie.work.gpu import GpuLease, holder, in_mode
from eyrie.work.queue import connect

PROGRESS = re.compile(r"(\d{1,3})%\|")  # tqdm bars, e.g. vLLM's "Loading safetensors ... 37%|"


def command(settings: Settings, model: str, serve=None) -> list[str]:
    """The real command line of the server. `serve`: the run config's serve section, which
    replaces the EYRIE_* vLLM flags (kept for `eyrie serve` without a run config)."""
    if settings.server == "vllm":
        cmd = [*serve_argv(settings.vllm_command, model), "--host", settings.host, "--port", str(settings.port)]
        return cmd + (serve or ServeSection.of_host(settings)).vllm_flags()
    binary = Path(sys.executable).with_name("transformers")
    return [str(binary if binary.exists() else "transformers"), "serve", model, "--host", settings.host,
            "--port", str(settings.port), "--device", "cpu"]


def run_config(config: Path | None, run: str | None):
    """`eyrie serve --config RUN.yaml` or `--run NAME` (the stored config): the run to serve
    (`--run active` is serve_active's)."""
    if config is not None:
        return load_config(config)
    if run is None:
        return None
    cfg = stored_config(open_store(load_settings()), run)
    if cfg is None:
        raise EyrieError(f"no stored run config for run {run}.", "start it with `eyrie run --config RUN.yaml` first.")
    return cfg


def serve_active(**flags) -> int:
    """`eyrie serve --run active` (the stack's inference service): serve each pipeline that is to
    generate, one after another, in the order they started (eyrie.runs.serve_turns), for as long as
    the service runs. Between runs it holds nothing; a run's server stops once its generation drains
    (the GPUs go to its later stages) and the next run's waits for them to come back, or once it is
    done or cannot go on while the next run, on another target, waits its turn. Returns on SIGTERM
    (0) or when a server fails (non-zero: the service restarts). `flags`: the command line's
    settings (port, server, host)."""
    settings = load_settings(**flags)
    conn, store = connect(settings.redis_url), open_store(settings)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            print("eyrie serve: waiting for a pipeline to generate (`eyrie run --config RUN.yaml`)", flush=True)
            while (run := generating_run(conn, store)) is None:
                time.sleep(Server.POLL_S)
            print(f"eyrie serve: serving run {run}'s target", flush=True)
            cfg = stored_config(store, run)
            server = Server(load_settings(model=cfg.target.model, **flags), conn, cfg.target.model, cfg.serve, run)
            code = server.run()
            if code or server.interrupted:
                return code
    except KeyboardInterrupt:
        print("eyrie serve: stopping", flush=True)
        return 0


def generating_run(conn, store) -> str | None:
    """The first active pipeline in serve order (eyrie.runs.serve_turns) whose generation can still
    go on (can_go_on): one that failed, is blocked or cancelled holds no server (and no GPUs)."""
    return next(iter(serve_turns.serve_order(conn, store)), None)


def health_path(server: str) -> str:
    # transformers serve lists only the hub cache in /v1/models: /health is its readiness probe
    return "/v1/models" if server == "vllm" else "/health"


class Server:
    def __init__(self, settings: Settings, conn, model: str, serve=None, run: str | None = None):
        """`run`: the pipeline served (`--run active`); the server stops once it can no longer generate."""
        self.settings, self.conn, self.serve, self.serving, self.target = settings, conn, serve, run, model
        info = describe(model)
        self.model = info.model if Path(model).is_dir() else model
        host = settings.host if settings.host not in ("0.0.0.0", "::") else socket.gethostname()
        self.endpoint = inference.Endpoint(
            name=settings.endpoint_name, weight=settings.endpoint_weight, url=settings.advertise_url or f"http://{host}:{settings.port}", model=self.model,
            server=settings.server, state="starting", host=socket.gethostname(),
            max_model_len=(serve.max_model_len if serve else None) or settings.max_model_len or info.max_model_len, revision=info.revision,
            chat_template_sha256=info.chat_template_sha256, run=run)
        self.proc: subprocess.Popen | None = None
        self.gpu: GpuLease | None = None
        self._stopping = False
        self.interrupted = False  # stopped by SIGTERM or ^C, not because its run's generation drained

    def env(self) -> dict[str, str]:
        return serve_env()

    def run(self) -> int:
        """Start, wait for readiness, then supervise until the server exits or we are stopped.
        SIGTERM stops it at any moment: waiting for the GPUs, loading or serving."""
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            if not self._start():
                return 0
            self._wait_ready()
            self._publish("ready")
            print(f"eyrie serve: ready at {self.endpoint.url} (model {self.model})", flush=True)
            while self.proc.poll() is None:
                time.sleep(self.POLL_S)
                self._publish("ready")
                if self._drained():
                    break
            else:
                self._crashed()
        except KeyboardInterrupt:
            self.interrupted = True
            print("eyrie serve: stopping", flush=True)
        finally:
            self.stop()
        return 0

    def _start(self) -> bool:
        """vLLM under the GPU lease (it owns the GPUs while it runs); False: nothing to serve now."""
        cmd = self.command()
        if self.settings.server == "vllm":
            if self.settings.gpu_scheduler == "kueue" and self._drained():
                # admitted while another run's later stages wait: its quota goes back at once
                # (the next GPU Job to finish queues this server again: gpu_admission.resume_waiting)
                return False
            self._wait_turn()
            lease = gpu_lease(self.settings, self.conn, f"{self.OWNER}@{socket.gethostname()}")
            self.gpu = in_mode(lease, self.gpu_mode())
            print("eyrie serve: waiting for the GPU lease", flush=True)
            if not self._acquire_gpus():
                return False
            threading.Thread(target=self._renew_gpu_lease, daemon=True).start()
        print(f"eyrie serve: {shlex.join(with_cpu_dtype(cmd))}", flush=True)  # as start_server runs it
        self.proc = start_server(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env(),
                                 text=True, bufsize=1)
        threading.Thread(target=self._follow_output, daemon=True).start()
        self._publish("starting", progress="")
        return True

    def _acquire_gpus(self) -> bool:
        """The GPU lease, published meanwhile as `waiting` (who holds the GPUs): the run's tasks wait
        for a server that is on its way (for at most EYRIE_GPU_WAIT_S: eyrie.work.gpu_wait). False:
        the run served can no longer use it (`_given_up`, asked every POLL_S): it stops waiting."""
        acquired, asked = threading.Event(), time.monotonic()

        def given_up() -> None:
            nonlocal asked
            if time.monotonic() - asked >= self.POLL_S:
                asked = time.monotonic()
                if self._given_up():
                    raise _NotNeeded()

        def announce() -> None:
            while not acquired.is_set():
                found = holder(self.conn)
                owner = (found or {}).get("holder") or {}
                self._publish("waiting", progress=f"waiting for the GPUs ({owner.get('owner', 'being handed over')} "
                                                  "holds them)")
                acquired.wait(self.POLL_S)

        announcer = threading.Thread(target=announce, daemon=True)
        announcer.start()
        try:
            return self.gpu.acquire(stop=given_up)
        except _NotNeeded:
            print(f"eyrie serve: run {self.serving} no longer needs the server (it failed for good, or is done, "
                  "blocked, cancelled or no longer active): no longer waiting for the GPUs", flush=True)
            return False
        finally:
            acquired.set()
            announcer.join()

    def _crashed(self) -> None:
        """The server exited by itself after it was ready: fail, so that a supervisor (Compose's
        `restart: on-failure`) starts it again."""
        if self._stopping:
            return
        self._publish("failed")
        raise EyrieError(f"the {self.settings.server} server exited with code {self.proc.returncode} "
                         "after it was ready (its output is above).",
                         "read the server's last lines (out of GPU memory, a crashed worker); "
                         "the service restarts it by itself under `restart: on-failure`.")

    POLL_S = 5
    STOP_GRACE_S = 30  # vLLM's time to exit on SIGTERM before it is killed
    # a run whose generation failed (or that is blocked or cancelled) hands the GPUs back within
    # this long of its last generate task failing for good: seen at the next poll, then vLLM stopped
    RELEASE_S = POLL_S + STOP_GRACE_S
    OWNER = "inference"

    def command(self) -> list[str]:
        return command(self.settings, self.model, self.serve)

    def gpu_mode(self) -> str:
        """How its GPU lease shares (eyrie.work.gpu): the GPUs are vLLM's own."""
        return "own"

    def _wait_turn(self) -> None:
        """Started (or restarted) while a drained pipeline's later stages need the GPUs: wait for them."""
        while run := self._drained_run():
            self._publish("waiting", progress=f"waiting for the GPUs (run {run}'s later stages need them)")
            time.sleep(self.POLL_S)

    def _drained(self) -> bool:
        """Stop now: a pipeline's generation drained and its later stages wait, or the run served gave up."""
        run = self._drained_run()
        if run and self.proc is not None:
            print(f"eyrie serve: run {run}'s generation has drained and its later stages wait: "
                  "stopping the server and handing over the GPUs", flush=True)
        return run is not None or self._given_up()

    def _given_up(self) -> bool:
        """The run served can no longer generate, and has not finished generating (its generation
        failed for good, or it is blocked, cancelled or no longer active: `eyrie retry` or a rerun
        serves it again) or has while the next run in serve order, on another target, waits its
        turn. The next run on the same target is served on; a finished run with none after it is
        drained's to stop (EYRIE_SERVE_STOP_WHEN_DRAINED)."""
        run = self.serving
        if run is None:
            return False
        store = open_store(self.settings)
        if can_go_on(self.conn, store, run, PIPELINE[0]):
            return False
        after = generating_run(self.conn, store)
        if after is not None and serve_turns.same_server(store, after, self.endpoint, self.target):
            print(f"eyrie serve: serving run {after} next (the same target)", flush=True)
            self.serving = self.endpoint.run = after
            return False
        if PIPELINE[0].done(run_view(self.conn, store, run)):
            if after is not None and self.proc is not None:
                print(f"eyrie serve: run {run}'s generation is done and run {after} waits its turn (another "
                      f"target): stopping the server for run {after}'s", flush=True)
            return after is not None
        if self.proc is not None:
            print(f"eyrie serve: run {run} can no longer generate (its generation failed, or it is blocked, "
                  "cancelled or no longer active): stopping the server and handing over the GPUs", flush=True)
        return True

    def _drained_run(self) -> str | None:
        stop = self.settings.serve_stop_when_drained
        if not (self.settings.server == "vllm" if stop is None else stop):
            return None
        return drained_run(self.conn, open_store(self.settings))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.serve_deadline_s
        url = f"http://127.0.0.1:{self.settings.port}{health_path(self.settings.server)}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._publish("failed")
                raise EyrieError(f"the {self.settings.server} server exited with code {self.proc.returncode} "
                                 "before it answered (its output is above).",
                                 "read the server's last lines; common causes: wrong model path, "
                                 "port in use, not enough GPU memory.")
            try:
                if requests.get(url, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self._publish("failed")
        raise EyrieError(f"the server did not answer {url} within {self.settings.serve_deadline_s:g} s.",
                         "raise EYRIE_SERVE_DEADLINE_S (large models load for tens of minutes) or read "
                         "the server's output above.")

    def _renew_gpu_lease(self) -> None:
        """Renewed through the whole load (vLLM may load for tens of minutes) and serving."""
        while True:
            time.sleep(10)
            if self.gpu is None or self.endpoint.state not in ("starting", "ready"):
                return  # stopped: the lease is (being) returned
            self.gpu.renew()

    def _follow_output(self) -> None:
        for line in self.proc.stdout:
            sys.stdout.write(line)
            match = PROGRESS.search(line)
            if match and self.endpoint.state == "starting":
                self.endpoint.progress = line.strip()[-120:]
                self._publish("starting")

    def _publish(self, state: str, progress: str | None = None) -> None:
        self.endpoint.state = state
        if progress is not None:
            self.endpoint.progress = progress
        inference.publish(self.conn, self.endpoint)

    def stop(self) -> None:
        """vLLM stopped (within STOP_GRACE_S), then the endpoint published `stopped` and the GPU lease
        returned. On SIGTERM with Redis away those fail at their first error (stop_requested), so
        the stop ends within STOP_GRACE_S and a few seconds whether Redis answers or not."""
        self._stopping = True
        if self.proc:
            stop_server(self.proc, grace_s=self.STOP_GRACE_S)  # the whole group: vLLM's engine core goes with it
        try:
            if self.endpoint.state != "failed":
                self._publish("stopped")
            if self.gpu:  # released only once the server has exited and freed the memory
                self.gpu.release()
        except redis.exceptions.RedisError as exc:
            if not stop_requested():
                raise
            print(f"eyrie serve: stopped; Redis did not answer ({exc}): its record of the endpoint is left as it "
                  "was, and the GPU lease lapses by itself", flush=True)


class _NotNeeded(Exception):
    """The run a server waits for the GPUs for can no longer use it: the wait ends."""


def _interrupt(signum, frame):
    """SIGTERM, seen as a worker's is (eyrie.work.cancel.STOP_REQUESTED): Redis commands stop waiting
    out an away Redis, so the stop ends within its bound."""
    STOP_REQUESTED.set()
    raise KeyboardInterrupt  # unwinds to Server.run's finally: the server stops, the lease is returned
