"""One vLLM OpenAI server process (our engine), started or attached to, driven over HTTP.

Contract:

- ``EngineProcess(model_dir, work_dir=..., ...)`` describes an engine; ``await start()`` launches
  ``python -m replica.vllm_server`` (vLLM's ``vllm.entrypoints.openai.api_server`` with the
  per-choice weight-version spans of ``replica/vllm_server.py``) for ``model_dir`` on 127.0.0.1 with dev-mode
  routes on (``VLLM_SERVER_DEV_MODE=1``), BF16, eager mode, a small KV cache
  (``VLLM_CPU_KVCACHE_SPACE``), ``--served-model-name``, ``--max-model-len``, ``--max-num-seqs``
  and our worker extension (``replica.engine_extension.WeightLoaderExtension``), then waits until
  ``/health`` and ``/v1/models`` answer. A start that fails or times out raises
  ``EngineStartError`` carrying the tail of the log, and stops what it started.
- Every route but ``GET /health`` needs the engine's secret (``replica/engine_guard.py``), and
  only the routes this class and the gateway use are on. ``secret`` (default: a fresh random
  one; the replica agent passes ``Settings.engine_secret``) reaches the server through a 0600
  file in ``work_dir`` named by ``ROLLOUTS_ENGINE_SECRET_FILE`` (never its command line), which
  ``start()`` removes once the server serves; every request of this class carries it
  (``auth_headers``).
- Everything the process writes goes under ``work_dir``: its log (``engine.log`` unless
  ``log_path`` says otherwise) and, through ``TMPDIR`` / ``VLLM_CACHE_ROOT`` /
  ``VLLM_CONFIG_ROOT`` / ``HF_HOME`` / ``XDG_*``, vLLM's IPC files and caches. Usage
  statistics are off and Hugging Face is offline: nothing leaves the machine.
- ``EngineProcess.attach(base_url, pid=None, secret=None)`` drives an engine someone else started
  (without its secret only ``health()`` works); ``stop()`` on it signals ``pid`` if given (it
  cannot reap it).
- Async control methods (httpx) map to vLLM's dev-mode routes and to the extension's methods
  over ``/collective_rpc`` (see ``replica/engine_extension.py`` for their JSON):
  ``pause``, ``resume``, ``is_paused``, ``reset_prefix_cache``, ``collective_rpc``,
  ``load_weights_from_files``, ``checksums``, ``weight_specs``, ``save_weights``,
  ``engine_pids``, ``peer_init`` / ``peer_send`` / ``peer_receive`` / ``peer_close``, and
  ``vllm_weight_checksums`` (vLLM's own worker checksums, over ``/collective_rpc``).
  Non-2xx answers raise ``EngineRequestError`` with the status and body.
- ``stop()``: SIGTERM to the server, wait, then SIGKILL to its whole process group (the server,
  the engine core and the worker: the server is started in a session of its own) on timeout.

Measured on the shared 2-core CPU machine with the embedded model (tests/replica/test_engine.py
prints them; ranges span quiet to heavily loaded, load average up to ~15):

- start to ready: 38-145 s (engine init itself ~3 s; the rest is imports and three process
  spawns: API server, engine core, worker); ``stop()`` by SIGTERM: ~1.5 s.
- pause window, client side, with 6 requests streaming: ``pause(keep)`` 25-67 ms,
  ``load_weights_from_files`` of the counting model's 10 changed tensors (3.0 MB) 17-68 ms
  (inside the engine: read 3-8 ms + apply 9-17 ms), ``resume`` 7-56 ms; window 60-180 ms.
  A full 39-tensor load (7.9 MB) takes 41-217 ms. A ``/pause`` over a NEW connection to a server
  busy streaming once took ~0.9 s (before the engine pauses, so requests are not frozen longer):
  this class pools its connection for 60 s and asks the server to keep idle ones for 75 s
  (vLLM's default is 5 s).
- the API server's streams lag the engine under load: a client that had seen 2 tokens of a
  stream was looking at a request the engine had already taken ~600 tokens into.
- peer transfer engine to engine (gloo, 3.0 MB): ``peer_init`` 0.1-0.5 s; send + receive + apply
  0.28-1.13 s (receiver: recv 60-610 ms, which includes waiting for the sender's RPC to arrive,
  apply 13-697 ms; the high ends under heavy load).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from common.processes import free_port
from common.settings import ENGINE_SECRET_HEADER
from replica.engine_guard import SECRET_FILE_ENV

EXTENSION_CLS = "replica.engine_extension.WeightLoaderExtension"
REPO_ROOT = Path(__file__).resolve().parents[1]


class EngineError(RuntimeError):
    pass


class EngineStartError(EngineError):
    pass


class EngineRequestError(EngineError):
    def __init__(self, method: str, path: str, status: int, body: str):
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


def _tail(path: Path | None, max_bytes: int = 6000) -> str:
    if path is None or not path.exists():
        return "(no log)"
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        return f.read().decode("utf-8", "replace")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class EngineProcess:
    """A vLLM OpenAI server for one model directory; see the module docstring."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        work_dir: Path | str,
        served_model_name: str = "model",
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | str | None = None,
        max_model_len: int = 1024,
        max_num_seqs: int = 32,
        kv_cache_gib: int = 1,
        dtype: str = "bfloat16",
        worker_extension_cls: str | None = EXTENSION_CLS,
        python: str = sys.executable,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        secret: str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.work_dir = Path(work_dir)
        self.served_model_name = served_model_name
        self.host = host
        self.port = port
        self.log_path = Path(log_path) if log_path else self.work_dir / "engine.log"
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache_gib = kv_cache_gib
        self.dtype = dtype
        self.worker_extension_cls = worker_extension_cls
        self.python = python
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.secret: str | None = secret or secrets.token_urlsafe(32)
        self._job_results: dict[str, Path] = {}  # background job kind -> its result file
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._base_url: str | None = None
        self._clients: dict[int, httpx.AsyncClient] = {}
        self.start_seconds: float | None = None

    # -- identity ---------------------------------------------------------------------------

    @classmethod
    def attach(cls, base_url: str, *, pid: int | None = None, served_model_name: str | None = None,
               secret: str | None = None) -> EngineProcess:
        """An EngineProcess for an engine that is already running at ``base_url``; ``secret``:
        that engine's (without it, the engine refuses everything but ``/health``)."""
        self = cls("", work_dir=".", served_model_name=served_model_name or "")
        self.secret = secret
        self._base_url = base_url.rstrip("/")
        self._pid = pid
        return self

    @property
    def auth_headers(self) -> dict[str, str]:
        """The header that gets a request past the engine's guard (empty without a secret)."""
        return {ENGINE_SECRET_HEADER: self.secret} if self.secret else {}

    @property
    def secret_path(self) -> Path:
        """Where ``start()`` hands the secret to the server (removed once it serves)."""
        return self.work_dir / "engine.secret"

    @property
    def pid(self) -> int | None:
        """The API server's pid (the engine core and worker are its children)."""
        return self._pid

    @property
    def base_url(self) -> str:
        if self._base_url is None:
            raise EngineError("engine not started")
        return self._base_url

    @property
    def owned(self) -> bool:
        """True when this object started the process (and so may reap it)."""
        return self._proc is not None

    def command(self) -> list[str]:
        assert self.port is not None
        cmd = [
            # vLLM's OpenAI server, plus each choice's per-token weight-version spans.
            self.python, "-m", "replica.vllm_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--dtype", self.dtype,
            "--enforce-eager",
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            # usage.prompt_tokens_details.cached_tokens: what trainers (cwtrain) read as cache hits.
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if self.worker_extension_cls:
            cmd += ["--worker-extension-cls", self.worker_extension_cls]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        tmp = self.work_dir / "tmp"
        cache = self.work_dir / "cache"
        env.update(
            {
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                # Keep every file the engine writes under work_dir, and nothing leaves the machine.
                "TMPDIR": str(tmp),
                "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "VLLM_CONFIG_ROOT": str(cache / "vllm-config"),
                "HF_HOME": str(cache / "hf"),
                "XDG_CACHE_HOME": str(cache),
                "XDG_CONFIG_HOME": str(cache / "config"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                "TRITON_CACHE_DIR": str(cache / "triton"),
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_DO_NOT_TRACK": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
                # Keep the control connection warm between calls (vLLM's default is 5 s).
                "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",
                # The worker imports our extension by name: make the repo importable.
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
                ),
            }
        )
        env.update(self.extra_env)
        env[SECRET_FILE_ENV] = str(self.secret_path)
        return env

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, timeout: float = 600.0) -> EngineProcess:
        """Launch the server and wait until it serves; raises EngineStartError."""
        if self._proc is not None or self._base_url is not None:
            raise EngineError("already started or attached")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("tmp", "cache"):
            (self.work_dir / sub).mkdir(exist_ok=True)
        if self.port is None:
            self.port = free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._write_secret()
        t0 = time.monotonic()
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(self.command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                cwd=str(self.work_dir),
                # A session of its own: stop() can kill the server, engine core and worker
                # together by process group if SIGTERM is not enough.
                start_new_session=True,
            )
        self._pid = self._proc.pid
        self._base_url = f"http://{self.host}:{self.port}"
        try:
            await self.wait_ready(timeout)
        except BaseException:
            await self.stop()
            raise
        finally:
            self.secret_path.unlink(missing_ok=True)  # the server read it before it served
        self.start_seconds = time.monotonic() - t0
        return self

    def _write_secret(self) -> None:
        if not self.secret:
            raise EngineError("an engine needs a secret")
        self.secret_path.unlink(missing_ok=True)
        fd = os.open(self.secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.secret)

    async def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5.0, headers=self.auth_headers) as client:
            while True:
                if self._proc is not None and self._proc.poll() is not None:
                    raise EngineStartError(
                        f"vLLM exited with code {self._proc.returncode} before it served "
                        f"(log {self.log_path}):\n{_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    health = await client.get(self.base_url + "/health")
                    if health.status_code == 200:
                        models = await client.get(self.base_url + "/v1/models")
                        if models.status_code == 200 and models.json().get("data"):
                            return
                if time.monotonic() > deadline:
                    raise EngineStartError(
                        f"vLLM at {self.base_url} not ready after {timeout:.0f}s "
                        f"(log {self.log_path}):\n{_tail(self.log_path)}"
                    )
                await asyncio.sleep(0.5)

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL the process group. Returns the exit code
        when this object started the process; None for an attached one."""
        await self.aclose()
        pid = self._pid
        if pid is None:
            return None
        if self._proc is not None:
            proc = self._proc
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + timeout
                while proc.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
            # The engine core and worker share the server's process group; wait for them too.
            await self._kill_group_leftovers(pid)
            return proc.returncode
        if _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _pid_alive(pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            if _pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return None

    async def _kill_group_leftovers(self, pgid: int, grace: float = 10.0) -> None:
        """Children that outlive the server (the engine core exits on its own after the
        server's SIGTERM, but give it a bounded grace period) get SIGKILL."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            await asyncio.sleep(0.2)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    async def __aenter__(self) -> EngineProcess:
        if self._base_url is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- HTTP -------------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        # One client per event loop: an httpx.AsyncClient's pool is bound to the loop it ran on.
        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None or client.is_closed:
            client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self.auth_headers,
                timeout=httpx.Timeout(600.0, connect=10.0),
                # Below the server's keep-alive (75 s, set in environment()), so a pooled
                # connection is never one the server has just closed.
                limits=httpx.Limits(keepalive_expiry=60.0),
            )
            self._clients[id(loop)] = client
        return client

    async def aclose(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            with contextlib.suppress(Exception):
                await client.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        client = self._client()
        resp = await client.request(method, path, **kwargs)
        if resp.status_code // 100 != 2:
            if resp.status_code >= 500:
                # vLLM's server drops the keep-alive connection after an unhandled exception
                # (e.g. a failing collective_rpc); a pooled connection would then fail the
                # next request with ReadError. Start the next request on a fresh pool.
                self._clients.pop(id(asyncio.get_running_loop()), None)
                await client.aclose()
            raise EngineRequestError(method, path, resp.status_code, resp.text)
        return resp

    async def health(self) -> bool:
        try:
            return (await self._client().get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self.request("GET", "/v1/models")).json()["data"]]

    # -- pause / resume / cache -------------------------------------------------------------

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Pause generation. ``keep`` freezes running requests in place (their KV cache kept) and
        queues new ones until ``resume``; ``wait`` drains running requests; ``abort`` aborts them.

        ``clear_cache`` (vLLM 0.32, checked in ``EngineCore._finish_pause``; its route's
        docstring says keep ignores it, but the code does not): at the pause, preempt running
        requests and drop the prefix cache, so after ``resume`` they are recomputed on whatever
        weights the engine then holds. False keeps the KV cache: a frozen request continues over
        its old KV with the new weights. Returns when the engine is paused.
        """
        await self.request(
            "POST", "/pause", params={"mode": mode, "clear_cache": "true" if clear_cache else "false"}
        )

    async def resume(self) -> None:
        await self.request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self.request("GET", "/is_paused")).json()["is_paused"])

    async def reset_prefix_cache(self) -> bool:
        """True when vLLM reset the prefix cache (it refuses while requests hold blocks)."""
        resp = await self.request("POST", "/reset_prefix_cache")
        with contextlib.suppress(ValueError):
            body = resp.json()
            if isinstance(body, dict) and "success" in body:
                return bool(body["success"])
        return True

    # -- the extension ----------------------------------------------------------------------

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call a worker method; returns one JSON result per worker (one at TP=1)."""
        resp = await self.request(
            "POST", "/collective_rpc", json={"method": method, "args": list(args), "kwargs": kwargs}
        )
        if not resp.content:
            return []
        return resp.json()["results"]

    async def _rpc1(self, method: str, *args: Any, **kwargs: Any) -> Any:
        results = await self.collective_rpc(method, *args, **kwargs)
        if len(results) != 1:
            # More than one worker (TP/PP > 1): the caller must combine per-worker results.
            raise EngineError(f"{method}: expected one worker result, got {len(results)}")
        return results[0]

    async def engine_pids(self) -> dict[str, int]:
        """``{"server": API server pid (if known), "worker": ..., "worker_parent": ...}``."""
        r = await self._rpc1("engine_pid")
        out = {"worker": int(r["pid"]), "worker_parent": int(r["parent_pid"])}
        if self._pid is not None:
            out["server"] = self._pid
        return out

    async def load_weights_from_files(
        self,
        paths: Sequence[Path | str],
        names: Sequence[str] | None = None,
        *,
        verify: bool = True,
        expected_adler32: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Load tensors from safetensors files into the running engine, in place, all or
        nothing. Returns ``{"loaded": [...], "bytes", "read_s", "apply_s"}``."""
        return await self._rpc1(
            "load_weights_from_files",
            [str(p) for p in paths],
            None if names is None else list(names),
            verify,
            None if expected_adler32 is None else dict(expected_adler32),
        )

    async def checksums(self, names: Sequence[str] | None = None, algorithm: str = "adler32") -> dict[str, str]:
        """Per-tensor digest of what the engine holds, by checkpoint name."""
        r = await self._rpc1("weight_checksums", None if names is None else list(names), algorithm)
        return dict(r["checksums"])

    async def set_weight_version(self, version: str) -> None:
        """Tag the weights the engine serves (vLLM labels outputs with it; `/weight_info` reads it)."""
        await self.request("POST", "/update_weight_version", json={"new_version": version})

    async def weight_version(self) -> str | None:
        return (await self.request("GET", "/weight_info")).json().get("weight_version")

    async def save_weights(self, names: Sequence[str] | None, path: Path | str) -> dict[str, Any]:
        """Have the engine write what it holds for ``names`` (checkpoint names; all when None) to
        a safetensors file at ``path`` (on the engine's machine)."""
        return await self._rpc1("save_weights", None if names is None else list(names), str(path))

    async def weight_specs(self, names: Sequence[str] | None = None) -> list[list[Any]]:
        return (await self._rpc1("weight_specs", None if names is None else list(names)))["specs"]

    async def peer_init(
        self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0
    ) -> dict[str, Any]:
        return await self._rpc1("peer_init", host, port, rank, world_size, backend, timeout_s)

    async def peer_send(
        self, names: Sequence[str] | None = None, paths: Sequence[Path | str] | None = None, src: int = 0
    ) -> dict[str, Any]:
        return await self._rpc1(
            "peer_send",
            None if names is None else list(names),
            None if paths is None else [str(p) for p in paths],
            src,
        )

    async def peer_receive(
        self,
        specs: Sequence[Sequence[Any]],
        src: int = 0,
        verify: bool = True,
        expected_adler32: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        return await self._rpc1(
            "peer_receive",
            [list(s) for s in specs],
            src,
            verify,
            None if expected_adler32 is None else dict(expected_adler32),
        )

    async def peer_close(self) -> dict[str, Any]:
        return await self._rpc1("peer_close")

    # -- staged updates (the extension's background jobs) ---------------------------------

    async def job_status(self) -> dict[str, Any]:
        return await self._rpc1("job_status")

    async def _start_job(self, method: str, *args: Any, previous_wait_s: float = 90.0) -> dict[str, Any]:
        """Call an extension method that starts a background job; remember where it reports.

        The engine runs one job at a time. A job whose caller stopped waiting (a canceled step)
        still runs to its end, which is bounded (a peer group's join times out); a new job
        waits up to ``previous_wait_s`` for it instead of failing the step."""
        deadline = time.monotonic() + previous_wait_s
        while True:
            try:
                started = await self._rpc1(method, *args)
                break
            except EngineRequestError as exc:
                if "job is still running" not in exc.body or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)
        if isinstance(started, dict) and started.get("result_path"):
            self._job_results[str(started["kind"])] = Path(started["result_path"])
        return started

    async def wait_job(self, kind: str, timeout_s: float = 600.0, rpc_every_s: float = 5.0) -> dict[str, Any]:
        """Wait for the extension's background ``kind`` job; returns its result or raises
        EngineError with the job's error.

        Watches the job's result file every 5 ms (no RPC: each one keeps vLLM's worker
        busy-polling for a second) and asks the engine itself only every ``rpc_every_s`` (a job
        that could not write its file, an engine that died); without a file, every 20 ms."""
        deadline = time.monotonic() + timeout_s
        path = self._job_results.pop(kind, None)
        next_rpc = time.monotonic() + (rpc_every_s if path is not None else 0.0)
        try:
            while True:
                st: dict[str, Any] | None = None
                if path is not None and path.exists():
                    with contextlib.suppress(ValueError):  # written atomically: a foreign file
                        st = json.loads(path.read_text())
                if st is None and time.monotonic() >= next_rpc:
                    st = await self.job_status()
                    if st["kind"] != kind:
                        raise EngineError(f"no background {kind} job (the engine reports {st['kind']!r})")
                    next_rpc = time.monotonic() + (rpc_every_s if path is not None else 0.02)
                if st is not None and st["state"] == "done":
                    return st["result"]
                if st is not None and st["state"] == "failed":
                    raise EngineError(f"background {kind} failed: {st['error']}")
                if time.monotonic() > deadline:
                    raise EngineError(f"background {kind} still running after {timeout_s:.0f} s")
                await asyncio.sleep(0.005 if path is not None else 0.02)
        finally:
            if path is not None:
                path.unlink(missing_ok=True)

    async def stage_from_files(
        self, label: str, paths: Sequence[Path | str], names: Sequence[str] | None = None,
        expected_adler32: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Read and check tensors off the serving path; ``commit_staged(label)`` swaps them in."""
        await self._start_job(
            "stage_from_files", label, [str(p) for p in paths], None if names is None else list(names),
            None if expected_adler32 is None else dict(expected_adler32),
        )
        return await self.wait_job("stage")

    async def stage_from_arena(
        self, label: str, path: Path | str, entries: Sequence[Sequence[Any]], expected_adler32: Mapping[str, str],
        verify: bool = True, backup: tuple[Path | str, Mapping[str, int]] | None = None,
    ) -> dict[str, Any]:
        """Stage tensors the agent decoded into shared memory (``replica.stage_arena``):
        ``entries`` are ``[name, dtype, shape, offset]``, checked against ``expected_adler32``
        off the serving path (``verify``) and again, on what the engine holds, by
        ``commit_staged(label)``, which swaps them in. ``backup`` = (path, name -> offset): the
        host copy in shared memory, holding what the engine serves now, which the commit rolls
        back from (else the stage copies the engine's current values first)."""
        backup_path, backup_offsets = (str(backup[0]), dict(backup[1])) if backup is not None else (None, None)
        await self._start_job("stage_from_arena", label, str(path), [list(e) for e in entries],
                              dict(expected_adler32), verify, backup_path, backup_offsets)
        return await self.wait_job("stage")

    async def start_peer_stage_send(
        self, host: str, port: int, world_size: int, names: Sequence[str] | None = None,
        backend: str = "gloo", timeout_s: float = 300.0, external_store: bool = False,
    ) -> None:
        """Start broadcasting ``names`` to ranks 1..world_size-1 (``wait_job("send")``).
        ``external_store``: another process already hosts the rendezvous store at host:port."""
        await self._start_job("peer_stage_send", host, port, world_size, None if names is None else list(names),
                              backend, timeout_s, external_store)

    async def start_peer_stage_receive(
        self, label: str, host: str, port: int, rank: int, world_size: int, specs: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str] | None = None, save_path: Path | str | None = None,
        backend: str = "gloo", timeout_s: float = 300.0, external_store: bool = False,
    ) -> None:
        """Start receiving a broadcast into a stage (``wait_job("stage")``)."""
        await self._start_job(
            "peer_stage_receive", label, host, port, rank, world_size, [list(s) for s in specs],
            None if expected_adler32 is None else dict(expected_adler32),
            None if save_path is None else str(save_path), backend, timeout_s, external_store,
        )

    async def start_peer_send_files(
        self, host: str, port: int, world_size: int, paths: Sequence[Path | str], backend: str = "gloo",
        timeout_s: float = 300.0, external_store: bool = False,
    ) -> None:
        """Start broadcasting whole files to ranks 1..world_size-1 (``wait_job("send")``)."""
        await self._start_job("peer_send_files", host, port, world_size, [str(p) for p in paths], backend, timeout_s,
                              external_store)

    async def start_peer_receive_files(
        self, host: str, port: int, rank: int, world_size: int, specs: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str], out_dir: Path | str, backend: str = "gloo",
        timeout_s: float = 300.0, external_store: bool = False,
    ) -> None:
        """Start receiving broadcast files into ``out_dir`` (``wait_job("receive")``)."""
        await self._start_job("peer_receive_files", host, port, rank, world_size, [list(s) for s in specs],
                              dict(expected_adler32), str(out_dir), backend, timeout_s, external_store)

    async def served_checksums(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Adler-32 of what the engine serves, computed off the serving path (a background job)."""
        await self._start_job("checksum_job", None if names is None else list(names))
        return dict((await self.wait_job("checksums"))["checksums"])

    async def commit_staged(self, label: str) -> dict[str, Any]:
        """Swap the staged tensors in and prove them (call inside a pause); all or nothing: the
        result's ``verified`` counts the tensors read back and found equal to the stage's
        expected Adler-32 (``checksums``) or, without those, to the bytes staged."""
        return await self._rpc1("commit_staged", label)

    async def discard_staged(self) -> dict[str, Any]:
        return await self._rpc1("discard_staged")

    async def vllm_weight_checksums(self) -> dict[str, str]:
        """vLLM's own per-parameter SHA-256s (its worker's ``compute_weight_checksums``, what its
        ``/weight_checker`` route returns; that route is off here). Engine names, fused; see the
        extension's docstring for why they are blind to linear layers on a CPU engine without
        our patch."""
        out: dict[str, str] = {}
        for worker in await self.collective_rpc("compute_weight_checksums"):
            out.update(worker)
        return out

    def __repr__(self) -> str:
        return f"EngineProcess(model_dir={str(self.model_dir)!r}, base_url={self._base_url!r}, pid={self._pid})"


__all__ = [
    "EXTENSION_CLS",
    "EngineError",
    "EngineProcess",
    "EngineRequestError",
    "EngineStartError",
    "free_port",
]
