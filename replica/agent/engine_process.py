"""One vLLM OpenAI server process (the replica's engine), started or attached to.

``EngineProcess.start()`` launches ``python -m replica.engine.server`` with our worker
extension (`replica.launch`) and returns once ``/health`` and ``/v1/models`` answer; a failed
or timed-out start raises ``EngineStartError`` with the log's tail and stops what it started.
Invariants: the agent drives the engine at ``base_url`` (loopback unless it binds one address);
other hosts use ``public_url``; the engine's secret reaches it only through a 0600 file,
removed once it serves; everything it writes (log, caches, IPC files) stays under
``work_dir`` except the shared ``model_info_cache``; nothing leaves the machine (usage stats
off, Hugging Face offline). ``stop()`` escalates SIGTERM to SIGKILL of the whole process group.
The CPU build's thread and executor choices: docs/design.md, "Engine processes".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from common import envs
from common.addresses import AddressError, check_bind_host, host_port, interface_of, is_loopback, is_wildcard
from common.processes import free_port, pid_alive, terminate, wait_serving
from replica.agent.engine_rpc import EngineClient, EngineError, EngineRequestError, EngineStartError, ReadBackFailed
from replica.launch import (
    EXTENSION_CLS,
    NODE_ADDRESS_ENV,
    ROUTED_EXPERTS_FLAG,
    SECRET_FILE_ENV,
    SERVER_MODULE,
    TRITON_INTERPRETER_DIR,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
KV_CACHE_FLAG = "--kv-cache-memory-bytes"  # vLLM's; a CPU engine's default: ROLLOUTS_CPU_KV_CACHE_BYTES
INPROC_WORKER_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0": a one-rank CPU engine's worker runs in its engine core


@functools.cache
def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (``vllm-cpu``): only there do the engine's
    thread binding and OpenMP thread count apply (a CUDA build's workers keep vLLM's own)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def share_model_infos(shared: Path, link: Path) -> None:
    """Make ``link`` (the engine's ``VLLM_CACHE_ROOT/modelinfos``) the host's ``shared``
    directory (created private to this user)."""
    shared.mkdir(parents=True, exist_ok=True, mode=0o700)
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.readlink() == shared:
        return
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link)
    link.symlink_to(shared, target_is_directory=True)


class EngineProcess(EngineClient):
    """A vLLM OpenAI server for one model directory; see the module docstring."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        work_dir: Path | str,
        served_model_name: str = "model",
        host: str = "127.0.0.1",
        port: int | None = None,
        node_address: str | None = None,
        log_path: Path | str | None = None,
        max_model_len: int = 1024,
        max_num_seqs: int = 32,
        dtype: str = "bfloat16",
        worker_extension_cls: str | None = EXTENSION_CLS,
        python: str = sys.executable,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        secret: str | None = None,
        ranks: int = 1,
        model_info_cache: Path | str | None = None,
    ) -> None:
        super().__init__(secret=secret or secrets.token_urlsafe(32), ranks=ranks)
        self.model_dir = Path(model_dir)
        self.work_dir = Path(work_dir)
        self.served_model_name = served_model_name
        self.host = host  # what the server binds
        # Where other hosts reach it (the module docstring).
        self.node_address = node_address or ("127.0.0.1" if is_wildcard(host) else host)
        self.port = port
        self.log_path = Path(log_path) if log_path else self.work_dir / "engine.log"
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.dtype = dtype
        self.worker_extension_cls = worker_extension_cls
        self.python = python
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.model_info_cache = Path(model_info_cache) if model_info_cache else None
        self._proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None

    # -- identity ---------------------------------------------------------------------------

    @classmethod
    def attach(
        cls,
        base_url: str,
        *,
        pid: int | None = None,
        served_model_name: str | None = None,
        secret: str | None = None,
        **options: Any,
    ) -> EngineProcess:
        """An EngineProcess for an engine that is already running at ``base_url``; ``secret``:
        that engine's (without it, the engine refuses everything but ``/health``); ``options``:
        what a subclass's constructor needs besides."""
        self = cls("", work_dir=".", served_model_name=served_model_name or "", **options)
        self.secret = secret
        self._base_url = base_url.rstrip("/")
        self._pid = pid
        return self

    @property
    def control_host(self) -> str:
        """The address the agent drives the engine at: loopback unless it binds one address."""
        if is_wildcard(self.host):
            return "::1" if self.host == "::" else "127.0.0.1"
        return self.host

    @property
    def public_url(self) -> str:
        """``http://NODE_ADDRESS:PORT``: where other hosts (the gateway) reach the engine's
        inference routes; for an attached engine, its ``base_url``."""
        if self.port is None or self._proc is None:
            return self.base_url
        return f"http://{host_port(self.node_address, self.port)}"

    @property
    def secret_path(self) -> Path:
        """Where ``start()`` hands the secret to the server (removed once it serves)."""
        return self.work_dir / "engine.secret"

    @property
    def owned(self) -> bool:
        """True when this object started the process (and so may reap it)."""
        return self._proc is not None

    def command(self) -> list[str]:
        assert self.port is not None
        cmd = [
            # vLLM's OpenAI server, plus each choice's per-token weight-version spans.
            self.python, "-m", SERVER_MODULE,
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
        return cmd + self.kv_cache_args() + self.extra_args

    def kv_cache_args(self) -> list[str]:
        """A CPU engine's KV cache size as vLLM's flag (``ROLLOUTS_CPU_KV_CACHE_BYTES``), unless
        the deployment's engine config gives its own; none on a GPU build (vLLM sizes it there)."""
        if not cpu_build() or KV_CACHE_FLAG in self.extra_args:
            return []
        return [KV_CACHE_FLAG, str(envs.ROLLOUTS_CPU_KV_CACHE_BYTES.get())]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # vLLM's legacy variable would override the flag (its CPU platform reads it last).
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        tmp = self.work_dir / "tmp"
        cache = self.work_dir / "cache"
        env.update(
            {
                "VLLM_SERVER_DEV_MODE": "1",
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
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
            }
        )
        env[NODE_ADDRESS_ENV] = self.node_address
        # uvicorn's default, pinned: only a client on this host may rename itself with
        # X-Forwarded-For, so no other host can pass the guard's own-host check for control routes.
        env["FORWARDED_ALLOW_IPS"] = "127.0.0.1,::1"
        # vLLM's CPU backend binds a rank's OpenMP threads, its worker's main thread among them,
        # to cores; "auto" binds every TP 1 engine on a host to the same first core, whatever
        # else runs there. Unbound, the kernel spreads a host's engines over its cores; with as
        # many threads as "auto" gives (every core but one, kept for the scheduler).
        # (A tensor-parallel engine's ranks get their shares: ``env``, replica/agent/process.py.)
        if cpu_build() and CPU_BIND_ENV not in env and CPU_BIND_ENV not in self.extra_env:
            env[CPU_BIND_ENV] = "nobind"
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) - 1)))
        # vLLM's CPU backend runs even a one-rank engine's worker in a process of its own,
        # spawned, so it imports vLLM a third time (~9 s of a 26 s start). Without V1
        # multiprocessing its one worker runs inside the engine core (the API server still
        # talks to the engine core over its own process: vLLM's AsyncLLM always does).
        if cpu_build() and self.ranks == 1:
            env.setdefault(INPROC_WORKER_ENV, "0")
        # vLLM returns routed experts only from its Model Runner V2, which its CPU build refuses
        # without triton-cpu: there the V2 runner's Triton kernels run in Triton's interpreter
        # (replica/engine/triton_interpreter). A GPU build runs V2 with Triton by default.
        if cpu_build() and ROUTED_EXPERTS_FLAG in self.extra_args:
            env["PYTHONPATH"] = os.pathsep.join((str(TRITON_INTERPRETER_DIR), env["PYTHONPATH"]))
            env["TRITON_INTERPRET"] = "1"
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        if "NCCL_SOCKET_IFNAME" not in env and not is_loopback(self.node_address):
            interface = interface_of(self.node_address)
            if interface:
                env["NCCL_SOCKET_IFNAME"] = interface
        env.update(self.extra_env)
        env[SECRET_FILE_ENV] = str(self.secret_path)
        return env

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, timeout: float = 600.0, on_spawn: Callable[[int], object] | None = None) -> EngineProcess:
        """Launch the server and wait until it serves; raises EngineStartError. ``on_spawn(pid)``
        runs as soon as the process exists (the agent records its pid file there, so an engine
        whose agent is killed while it starts is found and stopped)."""
        if self._proc is not None or self._base_url is not None:
            raise EngineError("already started or attached")
        check_bind_host(self.host, "the engine's bind address (--engine-bind)")
        check_bind_host(self.node_address, "the engine's node address (--node-address)")
        if is_wildcard(self.node_address):
            raise AddressError(
                f"the engine's node address {self.node_address!r} is the wildcard: give the "
                "address other hosts reach this one at (--node-address)"
            )
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("tmp", "cache"):
            (self.work_dir / sub).mkdir(exist_ok=True)
        if self.model_info_cache is not None:
            share_model_infos(self.model_info_cache, self.work_dir / "cache" / "vllm" / "modelinfos")
        if self.port is None:
            self.port = free_port(self.host or "0.0.0.0")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._write_secrets()
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
        if on_spawn is not None:
            on_spawn(self._pid)
        self._base_url = f"http://{host_port(self.control_host, self.port)}"
        try:
            await self.wait_ready(timeout)
        except BaseException:
            await self.stop()
            raise
        finally:
            for path in self.secret_files():  # the server read them before it served
                path.unlink(missing_ok=True)
        self.start_seconds = time.monotonic() - t0
        return self

    def secret_files(self) -> dict[Path, str]:
        """What ``start()`` hands the server in 0600 files, removed once it serves: path -> secret."""
        return {self.secret_path: self.secret or ""}

    def _write_secrets(self) -> None:
        for path, secret in self.secret_files().items():
            if not secret:
                raise EngineError(f"an engine needs its secrets: none for {path.name}")
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secret)

    async def wait_ready(self, timeout: float = 600.0) -> None:
        """Until the server answers /health and lists its model; EngineStartError with its log's
        tail when it exits first or ``timeout`` passes."""
        async with httpx.AsyncClient(timeout=5.0, headers=self.auth_headers) as client:

            async def serving() -> bool:
                if (await client.get(self.base_url + "/health")).status_code != 200:
                    return False
                models = await client.get(self.base_url + "/v1/models")
                return models.status_code == 200 and bool(models.json().get("data"))

            await self._until_serving(serving, timeout)

    async def _until_serving(
        self,
        serving: Callable[[], Awaitable[bool]],
        timeout: float,
        name: str = "vLLM",
        not_yet: tuple[type[BaseException], ...] = (httpx.HTTPError,),
    ) -> None:
        """Until ``serving()`` is true (``not_yet``: the errors that mean not yet); EngineStartError
        naming ``name``, with its log's tail, when the process exits first or ``timeout`` passes."""
        await wait_serving(
            self._proc,
            serving,
            name=name,
            url=self.base_url,
            log_path=self.log_path,
            timeout=timeout,
            error=EngineStartError,
            not_yet=not_yet,
        )

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL the process group. Returns the exit code
        when this object started the process; None for an attached one."""
        await self.aclose()
        pid = self._pid
        if pid is None:
            return None
        if self._proc is not None:
            code = await terminate(self._proc, timeout)
            # The engine core and worker share the server's process group; wait for them too.
            await self._kill_group_leftovers(pid)
            return code
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while pid_alive(pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            if pid_alive(pid):
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

    def alive(self) -> bool:
        """Whether the server process runs (a zombie counts as gone)."""
        return self._pid is not None and pid_alive(self._pid)

    def __repr__(self) -> str:
        return f"EngineProcess(model_dir={str(self.model_dir)!r}, base_url={self._base_url!r}, pid={self._pid})"


__all__ = [
    "EXTENSION_CLS",
    "EngineError",
    "EngineProcess",
    "EngineRequestError",
    "EngineStartError",
    "ReadBackFailed",
    "free_port",
]
