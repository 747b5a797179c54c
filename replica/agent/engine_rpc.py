"""The agent's client of its engine: the engine's control routes and the extension's RPCs.

:class:`EngineClient` is the one engine interface the agent drives (``EngineControl``): the
routes of `replica.engine_routes` by name, through a :class:`Transport`, the only thing that
differs between engine kinds (our vLLM server: ``POST /rollouts/<name>``, secret in a header;
Dynamo's system server: ``POST /engine/rollouts/<name>``, secret in the body). Its pool methods
are no-ops here (a Dynamo worker's are not: `replica.agent.dynamo`). An error answer raises
``EngineRequestError``; a swap whose read-back differs raises ``ReadBackFailed`` naming the
tensors, after the engine rolled back. Connections are pooled for 60 s and the server keeps idle
ones 75 s, so a control call never waits behind a busy server's new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from common.settings import ENGINE_SECRET_HEADER
from contracts.engine_ranks import combine_map, combine_swap, slowest
from replica import rpc_file
from replica.engine_routes import DYNAMO_PREFIX, VLLM_PREFIX
from replica.peer_join import PeerJoin
from replica.stage_arena import shm_dir
from snapshots.regions import ServedWeights


class EngineError(RuntimeError):
    pass


class EngineStartError(EngineError):
    """The engine did not come up (it exited, or did not serve in time)."""


class EngineRequestError(EngineError):
    def __init__(self, method: str, path: str, status: int, body: str):
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


class ReadBackFailed(EngineError):
    """The engine's read-back inside the pause differs from what was staged for ``tensors``: the
    engine rolled them back (the replica's runtime then restores the label and the host copy and
    raises it again saying what was kept). Its name is the activity failure type the control plane
    sees and does not retry (``contracts.errors.READ_BACK_FAILED``)."""

    def __init__(self, message: str, tensors: list[str]) -> None:
        super().__init__(message)
        self.tensors = tensors

    @classmethod
    def of(cls, label: str, tensors: list[str]) -> ReadBackFailed:
        return cls(
            f"the read-back of {label!r} differs for {len(tensors)} tensor(s): {', '.join(tensors[:8])}", tensors
        )


def _whole(served: ServedWeights, shards_by: str) -> dict[str, str]:
    """The checksums of ``served``; EngineError when a rank holds only a shard of some tensor
    (``shards_by``: the method that reads shards)."""
    if served.regions:
        raise EngineError(
            f"the engine's ranks hold shards of {len(served.regions)} tensor(s) "
            f"({', '.join(sorted(served.regions)[:3])}): read them with {shards_by}"
        )
    return served.checksums


@dataclass(frozen=True)
class Transport:
    """Where an engine serves its control routes and where its secret goes (module docstring)."""

    prefix: str
    secret_in_body: bool

    def body(self, body: dict[str, Any], secret: str | None) -> dict[str, Any]:
        return {**body, "secret": secret} if self.secret_in_body else body

    def answer(self, path: str, resp: httpx.Response) -> dict[str, Any]:
        """The route's answer; EngineRequestError for an error (an HTTP status or in the body)."""
        try:
            answer = resp.json()
        except ValueError:
            answer = None
        error = answer.get("error") if isinstance(answer, dict) else None
        if resp.status_code // 100 == 2 and error is None and isinstance(answer, dict):
            return answer
        code = error.get("code", resp.status_code) if isinstance(error, dict) else resp.status_code
        message = error.get("message", str(error)) if isinstance(error, dict) else resp.text
        raise EngineRequestError("POST", path, int(code) if int(code) // 100 != 2 else 500, message)


VLLM_TRANSPORT = Transport(VLLM_PREFIX, secret_in_body=False)
DYNAMO_TRANSPORT = Transport(DYNAMO_PREFIX, secret_in_body=True)


class EngineClient:
    """An engine at ``base_url`` (module docstring): the ``EngineControl`` the agent drives."""

    transport = VLLM_TRANSPORT

    def __init__(
        self, base_url: str | None = None, *, secret: str | None = None, pid: int | None = None, ranks: int = 1
    ) -> None:
        self.secret = secret
        self.ranks = ranks  # tensor-parallel ranks of the engine: one answer each
        self._base_url = None if base_url is None else base_url.rstrip("/")
        self._pid = pid
        self._job_results: dict[str, list[Path | None]] = {}  # background job kind -> each rank's result file
        self._clients: dict[int, httpx.AsyncClient] = {}

    @property
    def auth_headers(self) -> dict[str, str]:
        """The header that gets a request past the engine's guard (empty without a secret)."""
        return {ENGINE_SECRET_HEADER: self.secret} if self.secret else {}

    @property
    def pid(self) -> int | None:
        """The API server's pid (the engine core and worker are its children)."""
        return self._pid

    @property
    def base_url(self) -> str:
        if self._base_url is None:
            raise EngineError("engine not started")
        return self._base_url

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

    async def control(self, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Call the engine route ``route`` (`replica.engine_routes`) with ``body``; its answer."""
        path = self.transport.prefix + route
        client = self._client()
        resp = await client.post(path, json=self.transport.body(body or {}, self.secret))
        if resp.status_code >= 500:
            # A server may drop the keep-alive connection after an unhandled exception; a pooled
            # connection would then fail the next request with ReadError. Start on a fresh pool.
            self._clients.pop(id(asyncio.get_running_loop()), None)
            await client.aclose()
        return self.transport.answer(path, resp)

    async def health(self) -> bool:
        try:
            return (await self._client().get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self.request("GET", "/v1/models")).json()["data"]]

    # -- the routing pool (a Dynamo worker's: replica/agent/dynamo.py) ----------------------

    async def leave_pool(self) -> None:
        """Out of the routing pool before a pause (an engine the gateway routes to: nothing)."""

    async def rejoin_pool(self) -> None:
        """Back into the routing pool after a pause, unless held out."""

    async def hold_out(self) -> None:
        """Out of the routing pool until `serve` (a joining replica)."""

    async def serve(self) -> None:
        """Into the routing pool: the deployment made this replica a member."""

    async def open_gate(self) -> None:
        """Let requests reach the engine (one started gated)."""

    @property
    def dynamo_worker(self) -> str:
        """The engine's Dynamo worker id in hex; empty for an engine that is none."""
        return ""

    @property
    def dynamo_namespace(self) -> str:
        return ""

    # -- pause / resume / cache -------------------------------------------------------------

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Pause generation and return once paused: ``keep`` freezes running requests (KV kept) and
        queues new ones; ``wait`` drains them; ``abort`` aborts them. ``clear_cache`` preempts
        running requests and drops the prefix cache, so they are recomputed on the weights held at
        ``resume``; without it a frozen request continues over its old KV.
        """
        await self.leave_pool()
        try:
            await self.control("pause", {"mode": mode, "clear_cache": clear_cache})
        except BaseException:
            await self.rejoin_pool()
            raise

    async def resume(self) -> None:
        await self.control("resume")
        await self.rejoin_pool()

    async def is_paused(self) -> bool:
        return bool((await self.control("is_paused"))["is_paused"])

    async def reset_prefix_cache(self) -> bool:
        """True when vLLM reset the prefix cache (it refuses while requests hold blocks)."""
        return bool((await self.control("reset_prefix_cache")).get("success", True))

    # -- the extension ----------------------------------------------------------------------

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call a worker method; returns one JSON result per worker (one at TP=1). A call whose
        JSON exceeds `replica.rpc_file.BODY_LIMIT` (lists that grow with the tensor count) goes
        as a file the engine reads (``call_from_file``), removed once it answered."""
        body = rpc_file.encode(method, list(args), kwargs)
        if len(body) <= rpc_file.BODY_LIMIT:
            return await self._post_rpc(method, list(args), kwargs)
        path = rpc_file.write_call(shm_dir(), body)
        try:
            return await self._post_rpc("call_from_file", [str(path)], {})
        finally:
            path.unlink(missing_ok=True)

    async def _post_rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
        answer = await self.control("collective_rpc", {"method": method, "args": args, "kwargs": kwargs})
        return list(answer.get("results") or [])

    async def _rpc1(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A method whose answer is the same on every rank (or rank 0's is the one asked for)."""
        results = await self.collective_rpc(method, *args, **kwargs)
        if not results:
            raise EngineError(f"{method}: no worker answered")
        return results[0]

    async def _rpc_ranks(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Every rank's answer (one per tensor-parallel rank, in rank order)."""
        results = await self.collective_rpc(method, *args, **kwargs)
        if not results:
            raise EngineError(f"{method}: no worker answered")
        return results

    async def engine_pids(self) -> dict[str, int]:
        """``{"server": API server pid (if known), "worker": ..., "worker_parent": ...}``."""
        r = await self._rpc1("engine_pid")
        out = {"worker": int(r["pid"]), "worker_parent": int(r["parent_pid"])}
        if self._pid is not None:
            out["server"] = self._pid
        return out

    async def weight_map(self) -> dict[str, Any]:
        """Have the engine build its map of the checkpoint's tensors to its parameters now (else
        the first stage does); what it holds in place and what it refuses, and why."""
        return combine_map(await self._rpc_ranks("weight_map"))

    async def refuse_tensors(self, names: Sequence[str], why: str) -> None:
        """Every rank refuses ``names`` from now on: a stage naming one is refused, naming it."""
        await self._rpc_ranks("refuse_tensors", list(names), why)

    async def checksums(self, names: Sequence[str] | None = None, algorithm: str = "adler32") -> dict[str, str]:
        """Per-tensor digest of what the engine holds, by checkpoint name; EngineError for a
        tensor that no rank holds whole (a tensor-parallel shard: `served_weights`)."""
        results = await self._rpc_ranks("weight_checksums", None if names is None else list(names), algorithm)
        return _whole(ServedWeights.combine(results), "served_weights")

    async def served_weights(self, names: Sequence[str] | None = None) -> ServedWeights:
        """What every rank holds for ``names`` (all when None): checksums of the tensors a rank
        holds whole, regions of the shards (`snapshots.regions`)."""
        return ServedWeights.combine(await self._rpc_ranks("weight_checksums", None if names is None else list(names)))

    async def set_weight_version(self, version: str) -> None:
        """Tag the weights the engine serves (vLLM labels outputs with it; `/weight_info` reads it)."""
        await self.control("update_weight_version", {"new_version": version})

    async def weight_version(self) -> str | None:
        return (await self.control("weight_info")).get("weight_version")

    async def save_weights(self, names: Sequence[str] | None, path: Path | str) -> dict[str, Any]:
        """Have the engine write what it holds for ``names`` (checkpoint names; all when None) to
        a safetensors file at ``path`` (on the engine's machine)."""
        return await self._rpc1("save_weights", None if names is None else list(names), str(path))

    async def weight_specs(self, names: Sequence[str] | None = None) -> list[list[Any]]:
        return (await self._rpc1("weight_specs", None if names is None else list(names)))["specs"]

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
                started = await self._rpc_ranks(method, *args)
                break
            except EngineRequestError as exc:
                if "job is still running" not in exc.body or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)
        first = started[0]
        if isinstance(first, dict) and first.get("kind"):
            self._job_results[str(first["kind"])] = [
                Path(r["result_path"]) if isinstance(r, dict) and r.get("result_path") else None for r in started
            ]
        return first

    async def wait_job(self, kind: str, timeout_s: float = 600.0, rpc_every_s: float = 5.0) -> dict[str, Any]:
        """:meth:`wait_job_ranks`, rank 0's result."""
        return (await self.wait_job_ranks(kind, timeout_s, rpc_every_s))[0]

    async def wait_job_ranks(
        self, kind: str, timeout_s: float = 600.0, rpc_every_s: float = 5.0
    ) -> list[dict[str, Any]]:
        """Wait for the extension's background ``kind`` job on every rank; returns each rank's
        result or raises EngineError with the job's error (naming the rank of a TP engine).

        Watches each rank's result file every 5 ms (no RPC: each one keeps vLLM's workers
        busy-polling for a second) and asks the engine itself only every ``rpc_every_s`` (a job
        that could not write its file, an engine that died); without a file, every 20 ms."""
        deadline = time.monotonic() + timeout_s
        paths = self._job_results.pop(kind, None) or [None]
        try:
            results = [
                await self._wait_rank(kind, rank, len(paths), path, deadline, timeout_s, rpc_every_s)
                for rank, path in enumerate(paths)
            ]
        finally:
            for path in paths:
                if path is not None:
                    path.unlink(missing_ok=True)
        return results

    async def _wait_rank(
        self, kind: str, rank: int, ranks: int, path: Path | None, deadline: float, timeout_s: float, rpc_every_s: float
    ) -> dict[str, Any]:
        who = f"background {kind}" + (f" on rank {rank}" if ranks > 1 else "")
        next_rpc = time.monotonic() + (rpc_every_s if path is not None else 0.0)
        while True:
            st: dict[str, Any] | None = None
            if path is not None and path.exists():
                with contextlib.suppress(ValueError):  # written atomically: a foreign file
                    st = json.loads(path.read_text())
            if st is None and time.monotonic() >= next_rpc:
                statuses = await self._rpc_ranks("job_status", kind)
                st = statuses[rank] if rank < len(statuses) else {"kind": None}
                if st["kind"] != kind:
                    raise EngineError(f"no {who} job (the engine reports {st['kind']!r})")
                next_rpc = time.monotonic() + (rpc_every_s if path is not None else 0.02)
            if st is not None and st["state"] == "done":
                return st["result"]
            if st is not None and st["state"] == "failed":
                raise EngineError(f"{who} failed: {st['error']}")
            if time.monotonic() > deadline:
                raise EngineError(f"{who} still running after {timeout_s:.0f} s")
            await asyncio.sleep(0.005 if path is not None else 0.02)

    async def stage_from_files(
        self,
        label: str,
        paths: Sequence[Path | str],
        names: Sequence[str] | None = None,
        expected_adler32: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Read and check tensors off the serving path; ``commit_staged(label)`` swaps them in."""
        await self._start_job(
            "stage_from_files",
            label,
            [str(p) for p in paths],
            None if names is None else list(names),
            None if expected_adler32 is None else dict(expected_adler32),
        )
        return await self.wait_job("stage")

    async def stage_from_arena(
        self,
        label: str,
        path: Path | str,
        entries: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str],
        verify: bool = True,
        backup: tuple[Path | str, Mapping[str, int]] | None = None,
    ) -> dict[str, Any]:
        """Stage tensors the agent decoded into shared memory (``replica.stage_arena``):
        ``entries`` are ``[name, dtype, shape, offset]``, checked against ``expected_adler32``
        off the serving path (``verify``) and again, on what the engine holds, by
        ``commit_staged(label)``, which swaps them in. ``backup`` = (path, name -> offset): the
        host copy in shared memory, holding what the engine serves now, which the commit rolls
        back from (else the stage copies the engine's current values first)."""
        backup_path, backup_offsets = (str(backup[0]), dict(backup[1])) if backup is not None else (None, None)
        await self._start_job(
            "stage_from_arena",
            label,
            str(path),
            [list(e) for e in entries],
            dict(expected_adler32),
            verify,
            backup_path,
            backup_offsets,
        )
        return await self.wait_job("stage")

    async def start_peer_stage_send(self, join: PeerJoin, names: Sequence[str] | None = None) -> None:
        """Start broadcasting ``names`` to the group's other ranks (``wait_job("send")``)."""
        await self._start_job("peer_stage_send", join.to_json(), None if names is None else list(names))

    async def start_peer_stage_receive(
        self,
        join: PeerJoin,
        label: str,
        specs: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str] | None = None,
        save_path: Path | str | None = None,
    ) -> None:
        """Start receiving a broadcast into a stage (``wait_job("stage")``)."""
        await self._start_job(
            "peer_stage_receive",
            join.to_json(),
            label,
            [list(s) for s in specs],
            None if expected_adler32 is None else dict(expected_adler32),
            None if save_path is None else str(save_path),
        )

    async def start_peer_send_files(self, join: PeerJoin, paths: Sequence[Path | str]) -> None:
        """Start broadcasting whole files to the group's other ranks (``wait_job("send")``)."""
        await self._start_job("peer_send_files", join.to_json(), [str(p) for p in paths])

    async def start_peer_receive_files(
        self,
        join: PeerJoin,
        specs: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str],
        out_dir: Path | str,
    ) -> None:
        """Start receiving broadcast files into ``out_dir`` (``wait_job("receive")``)."""
        await self._start_job(
            "peer_receive_files", join.to_json(), [list(s) for s in specs], dict(expected_adler32), str(out_dir)
        )

    async def served_checksums(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Adler-32 of what the engine serves, computed off the serving path (a background job);
        EngineError for a tensor no rank holds whole (a tensor-parallel shard: `served_shards`)."""
        return _whole(await self.served_shards(names), "served_shards")

    async def served_shards(self, names: Sequence[str] | None = None) -> ServedWeights:
        """What every rank serves (`served_weights`), computed off the serving path (a background
        job on every rank)."""
        await self._start_job("checksum_job", None if names is None else list(names))
        return ServedWeights.combine(await self.wait_job_ranks("checksums"))

    async def swap_staged(self, label: str) -> dict[str, Any]:
        """Load the stage ``label`` in place on every rank (call inside a pause); on a failure
        every rank is back on its tensors. ``commit_staged`` or ``discard_staged`` must follow."""
        try:
            return slowest(await self._rpc_ranks("swap_staged", label))
        except EngineRequestError:
            if self.ranks > 1:  # the ranks that swapped roll back
                with contextlib.suppress(Exception):
                    await self.discard_staged()
            raise

    async def commit_staged(self, label: str) -> dict[str, Any]:
        """Prove the swapped stage (inside the same pause): the result's ``verified`` counts the
        tensors read back and found equal to the stage's expected Adler-32 (``checksums``) or,
        without those, to the bytes staged. A difference raises ReadBackFailed (rolled back, on
        every rank)."""
        return await self._prove_ranks("commit_staged", label)

    async def swap_in_pause(
        self,
        label: str,
        previous: str,
        *,
        clear_cache: bool,
        expected: int,
        while_held: Callable[[], Awaitable[None]] | None = None,
    ) -> dict[str, Any]:
        """Swap the stage ``label`` in, inside one pause, in the engine (`replica.engine.swap`:
        the one transaction, all or nothing), out of the routing pool around it. ``while_held``:
        the engine holds after the write, paused, while it runs (the "swap" fault point); its
        failure rolls the swap back and is raised. Returns the engine's report with its
        ``timings_ms``; a read-back that differs raises ReadBackFailed."""
        body = {
            "label": label,
            "previous": previous,
            "clear_cache": clear_cache,
            "expected": expected,
            "ranks": self.ranks,
        }
        await self.leave_pool()
        try:
            answer = await (
                self.control("swap_in_pause", body) if while_held is None else self._swap_held(body, while_held)
            )
        finally:
            await self.rejoin_pool()
        result = dict(answer["result"])
        if result.get("read_back_failed"):
            raise ReadBackFailed.of(label, list(result["read_back_failed"]))
        result["timings_ms"] = answer["timings_ms"]
        return result

    async def _swap_held(self, body: dict[str, Any], while_held: Callable[[], Awaitable[None]]) -> dict[str, Any]:
        answer = await self.control("swap_in_pause", {**body, "hold": True})
        if not answer.get("held"):  # it ended before its hold
            return answer
        try:
            await while_held()
        except BaseException:
            with contextlib.suppress(Exception):  # the engine answers the roll-back it did as an error
                await self.control("swap_hook", {"proceed": False})
            raise
        return await self.control("swap_hook", {"proceed": True})

    async def _prove_ranks(self, method: str, label: str) -> dict[str, Any]:
        """One engine answer for a commit: at TP 1 the rank's; at TP > 1 every rank holds its
        proven stage until all proved (then releases it), and any rank's failure discards the
        stage on every rank (`contracts.engine_ranks`)."""
        if self.ranks == 1:
            results = await self._rpc_ranks(method, label)
            if len(results) != 1:  # a TP engine driven as one rank: undo, say so
                with contextlib.suppress(Exception):
                    await self.discard_staged()
                raise EngineError(f"{method}: {len(results)} ranks answered; this client drives {self.ranks}")
            result = results[0]
        else:
            try:
                result = combine_swap(await self._rpc_ranks(method, label, True))
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.discard_staged()
                raise
            if result.get("read_back_failed"):
                await self.discard_staged()
            else:
                await self._rpc_ranks("release_staged", label)
        if result.get("read_back_failed"):
            raise ReadBackFailed.of(label, list(result["read_back_failed"]))
        return result

    async def discard_staged(self) -> dict[str, Any]:
        """Drop the stage on every rank; a swapped one is rolled back (``rolled_back``)."""
        results = await self._rpc_ranks("discard_staged")
        return {"discarded": results[0].get("discarded"), "rolled_back": any(r.get("rolled_back") for r in results)}

    async def vllm_weight_checksums(self) -> dict[str, str]:
        """vLLM's own per-parameter SHA-256s (its worker's ``compute_weight_checksums``, what its
        ``/weight_checker`` route returns; that route is off here). Engine names, fused; see the
        extension's docstring for why they are blind to linear layers on a CPU engine without
        our patch."""
        out: dict[str, str] = {}
        for worker in await self.collective_rpc("compute_weight_checksums"):
            out.update(worker)
        return out
