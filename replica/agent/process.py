"""One replica process: its engine (``runtime.engine``: ``dynamo-vllm``, `replica.agent.dynamo`;
or ``vllm``, vLLM's OpenAI server), the host copy of its weights, and its Temporal agent.

`run_replica` clears what a killed agent left (its engine, dead shared memory), downloads the
model, starts the engine behind the replica's secret, loads the host copy, catches up to the
deployment's snapshot when asked, starts the agent on the replica's own task queue and reports
ready. Invariants: if the engine dies the replica reports the failure and exits; SIGTERM stops
the engine and exits. ``node_address`` is where other hosts reach it (engine URL, peer offers);
``engine_bind`` what the engine binds; the agent drives the engine over loopback unless it binds
one specific address. docs/design.md, "Processes and who runs what".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio.worker import Worker

from common.metrics import serve as serve_metrics
from common.processes import PidFile, freeze_heap, stop_pid
from common.settings import Settings, temporal_client
from common.telemetry import setup_tracing, temporal_interceptors
from contracts import names
from contracts.activities import ApplySnapshotInput
from contracts.engine_config import TP_KEY
from contracts.engine_ranks import HELD_BY_NO_RANK
from contracts.records import ReplicaEndpoint, ReplicaFailure, rfc3339
from replica import faults
from replica.agent.activities import PeerActivities, ReplicaActivities
from replica.agent.downloads import download_prefix, download_shared, shared_use
from replica.agent.dynamo import DynamoEngineProcess
from replica.agent.engine_process import CPU_BIND_ENV, EngineProcess
from replica.agent.engine_rpc import EngineRequestError
from replica.agent.host_decodes import remove_stale as remove_stale_decodes
from replica.agent.metrics import ReplicaMetrics
from replica.agent.peers import peer_backend
from replica.agent.retries import DELAYS_S, retrying
from replica.agent.runtime import ReplicaRuntime
from replica.agent.shm_reclaim import reclaim_dead_segments
from replica.agent.staged import one_line
from replica.stage_arena import StageArena, shm_dir
from snapshots.host import HostWeights

log = logging.getLogger("rollouts.replica")


def shared_model_dir(workflow_id: str, bucket: str, path: str) -> Path:
    """Where a dynamo deployment's replicas on this host find its model: the same path on every
    host (under the temporary directory, named by a digest of the deployment and the model)."""
    digest = hashlib.sha256(f"{workflow_id}\n{bucket}\n{path}".encode()).hexdigest()[:24]
    return Path(tempfile.gettempdir()) / "rollouts-models" / digest


def cpu_binding(ranks: int, cores: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks on ``cores`` cores: ``"0|1"`` for two on
    two, ``"0-1|2-3"`` for two on four; ranks share cores when there are fewer cores than ranks."""
    if cores < ranks:
        return "|".join(str(r % cores) for r in range(ranks))
    share = cores // ranks
    return "|".join(f"{r * share}" if share == 1 else f"{r * share}-{r * share + share - 1}" for r in range(ranks))


def engine_options(engine_config: dict[str, str]) -> dict[str, Any]:
    """EngineProcess options from a deployment's runtime.engineConfig: the sizes it knows by
    name, every other key as a vLLM flag (`--key value`, or `--key` for an empty value)."""
    config = dict(engine_config)
    options: dict[str, Any] = {}
    ranks = int(config.get(TP_KEY, "1") or 1)
    if ranks > 1:
        options["ranks"] = ranks
        # vLLM's CPU backend binds each rank's OpenMP threads to cores ("auto" wants a NUMA node
        # per rank): one share of this host's cores each. GPU platforms ignore it.
        options["env"] = {CPU_BIND_ENV: cpu_binding(ranks, os.cpu_count() or 1)}
    if "max-model-len" in config:
        options["max_model_len"] = int(config.pop("max-model-len"))
    if "max-num-seqs" in config:
        options["max_num_seqs"] = int(config.pop("max-num-seqs"))
    extra: list[str] = []
    for key, value in sorted(config.items()):
        extra += [f"--{key}"] + ([value] if value else [])
    if extra:
        options["extra_args"] = extra
    return options


async def log_weight_map(name: str, engine: EngineProcess) -> None:
    """Have the engine build its weight map now, not inside the first hot-load, and log what it
    cannot hot-load. A map that cannot be built does not stop the replica, which serves: every
    stage then refuses with the same error. Tensors that no rank holds (`combine_map`'s
    ``orphans``) are refused on every rank here, before any stage."""
    try:
        mapped = await engine.weight_map()
    except EngineRequestError as exc:
        log.warning("%s: no weight map, so no hot-load will stage: %s", name, one_line(exc))
        return
    if mapped["orphans"]:
        # Every rank found them another rank's: no rank would write or prove them. (An engine
        # that cannot take this refusal does not serve as a replica: the error stops its start.)
        await engine.refuse_tensors(mapped["orphans"], HELD_BY_NO_RANK)
        mapped["refused"].update(dict.fromkeys(mapped["orphans"][:4], HELD_BY_NO_RANK))
        mapped["refused_count"] += len(mapped["orphans"])
    log.info(
        "%s: %d of %d checkpoint tensors load in place (map built in %.2f s)",
        name,
        mapped["held"],
        mapped["tensors"],
        mapped["build_s"],
    )
    if mapped["refused_count"]:
        log.warning(
            "%s: %d checkpoint tensor(s) cannot be hot-loaded: %s",
            name,
            mapped["refused_count"],
            "; ".join(f"{n}: {why}" for n, why in list(mapped["refused"].items())[:4]),
        )


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica is asked to run (`run_replica`'s keyword arguments)."""

    deployment_id: str
    name: str
    workflow_id: str
    zone: str
    model_bucket: str
    model_path: str
    model_name: str
    catch_up: str | None = None  # an ApplySnapshotInput (JSON) to serve before taking traffic
    joining: bool = False  # a scale-out's replica: out of the routing pool until `serve_replica`
    runtime_engine: str = names.HOT_LOAD_ENGINE  # dynamo-vllm: Dynamo's vLLM worker; vllm: vLLM's server
    engine_config: dict[str, str] | None = None
    node: str = ""
    node_address: str | None = None  # where other hosts reach it (module docstring)
    engine_bind: str | None = None  # what its engine binds (module docstring)

    @property
    def dynamo(self) -> bool:
        return self.runtime_engine == names.HOT_LOAD_ENGINE


async def run_replica(settings: Settings, **kwargs: Any) -> int:
    """Run one replica until SIGTERM or its engine dies (module docstring); returns the exit
    status. What it holds while it runs (a dynamo deployment's shared model directory) is let go
    on every way out."""
    spec = ReplicaSpec(**kwargs)
    node_address = spec.node_address or settings.host
    spec = replace(spec, node_address=node_address, engine_bind=spec.engine_bind or node_address)
    with contextlib.ExitStack() as held:
        return await _run_replica(settings, spec, held)


async def _run_replica(settings: Settings, spec: ReplicaSpec, held: contextlib.ExitStack) -> int:
    """The phases: clear what a killed run left, start (model, engine, runtime), serve."""
    workdir = settings.home_path / "replicas" / spec.deployment_id / spec.name
    setup_tracing("rollouts-replica")
    metrics = ReplicaMetrics(spec.deployment_id, spec.name, spec.runtime_engine)
    metrics_url = serve_metrics(spec.node_address, settings.replica_metrics_port)
    client = await temporal_client(settings, interceptors=temporal_interceptors())
    deployment = client.get_workflow_handle(spec.workflow_id)
    engine_pid_file = PidFile(workdir / "engine.pid")
    await _clear_leftovers(engine_pid_file, spec.name)
    engine: EngineProcess | None = None
    try:
        s3 = settings.s3_client()
        backend = peer_backend(os.environ)  # a bad setting fails the start before the engine's
        model_dir = await _model_dir(settings, spec, s3, deployment, held, workdir)
        engine = _new_engine(settings, spec, model_dir, workdir)
        await engine.start(on_spawn=engine_pid_file.write)
        runtime = await _start_runtime(settings, spec, engine, model_dir, s3, workdir, backend)
    except Exception as exc:  # noqa: BLE001 - reported to the deployment, then exit
        log.exception("replica %s failed to start", spec.name)
        await deployment.signal(
            names.REPLICA_FAILED, ReplicaFailure(name=spec.name, reason=f"start failed: {one_line(exc)}; log {workdir}")
        )
        if engine is not None:
            await _stop_engine(engine)
        metrics.state("FAILED")
        return 1
    try:
        return await _serve(spec, client, deployment, engine, runtime, metrics, metrics_url)
    finally:
        runtime.withdraw_decode()  # its arena goes with this process
        await _stop_engine(engine)
        engine_pid_file.remove()
        shutil.rmtree(runtime.staging, ignore_errors=True)


async def _stop_engine(engine: EngineProcess) -> None:
    """Stop the engine and remove its work directory (its TMPDIR and caches: nothing there
    outlives it; the host's shared caches are links, which go, not what they point at)."""
    await engine.stop()
    shutil.rmtree(engine.work_dir, ignore_errors=True)


async def _clear_leftovers(engine_pid_file: PidFile, name: str) -> None:
    """Stop an engine a killed agent left (it may sit paused forever); reclaim the shared memory
    that killed engines (this replica's or others') left in /dev/shm, and killed agents' decode
    records."""
    leftover = engine_pid_file.alive_pid()
    if leftover is not None:
        log.warning("stopping engine %d left by a previous run of %s", leftover, name)
        stop_pid(leftover, timeout=20)
    await asyncio.to_thread(reclaim_dead_segments)
    for record in await asyncio.to_thread(remove_stale_decodes, shm_dir()):
        log.info("removed %s, the decode record of an agent that is gone", record)


async def _model_dir(
    settings: Settings, spec: ReplicaSpec, s3: Any, deployment: Any, held: contextlib.ExitStack, workdir: Path
) -> Path:
    """The deployment's model, read from the bucket; an S3 error that may pass is tried again
    (replica.agent.retries), the deployment told. A dynamo deployment's replicas on this host
    share one path, removed by the last one to leave (replica.agent.downloads)."""
    shared = shared_model_dir(spec.workflow_id, spec.model_bucket, spec.model_path)
    if spec.dynamo:
        await asyncio.to_thread(held.enter_context, shared_use(shared))

    async def download() -> Path:
        await faults.hit(settings.home_path, "model_download", replica=spec.name, deployment=spec.deployment_id)
        if spec.dynamo:
            return await asyncio.to_thread(download_shared, s3, spec.model_bucket, spec.model_path, shared)
        await asyncio.to_thread(download_prefix, s3, spec.model_bucket, spec.model_path, workdir / "model")
        return workdir / "model"

    async def retry_said(attempt: int, delay: float, exc: BaseException) -> None:
        why = (
            f"reading its model s3://{spec.model_bucket}/{spec.model_path} failed ({one_line(exc)}); "
            f"attempt {attempt + 1} of {len(DELAYS_S) + 1} in {delay:g} s"
        )
        log.warning("%s: %s", spec.name, why)
        with contextlib.suppress(Exception):  # the retry goes on whether or not the deployment heard
            await deployment.signal(names.REPLICA_RETRYING, ReplicaFailure(name=spec.name, reason=why))

    return await retrying(download, retry_said)


def _new_engine(settings: Settings, spec: ReplicaSpec, model_dir: Path, workdir: Path) -> EngineProcess:
    """The replica's engine, not started: Dynamo's vLLM worker or vLLM's OpenAI server."""
    options = dict(
        # vLLM binds IPC sockets under the engine's TMPDIR, and a socket path must stay under
        # 108 bytes: keep it short, outside the (possibly deep) stack home.
        work_dir=Path(tempfile.gettempdir()) / "rollouts-engines" / spec.name,
        host=spec.engine_bind,
        node_address=spec.node_address,
        log_path=workdir / "engine.log",
        # vLLM's record of each model class, shared by this host's engines (engine_process).
        model_info_cache=settings.engine_cache_dir / "modelinfos",
        # What the gateway derives too: the engine answers only this agent and the gateway.
        secret=settings.engine_secret(spec.workflow_id, spec.name),
        **engine_options(spec.engine_config or {}),
    )
    if not spec.dynamo:
        return EngineProcess(model_dir, served_model_name=spec.model_name, **options)
    # Dynamo's vLLM worker, found by Dynamo's frontend through the shared discovery dir.
    return DynamoEngineProcess(
        model_dir,
        served_model_name=names.dynamo_model(spec.workflow_id),
        discovery_dir=settings.dynamo_discovery_dir,
        namespace=names.dynamo_namespace(spec.workflow_id),
        frontend_url=settings.dynamo_frontend_url,
        kv_events=settings.dynamo_router_mode == "kv",
        discovery_backend=settings.dynamo_discovery_backend,
        tls=settings.dynamo_tls(),
        event_broker=settings.dynamo_event_broker,
        # What the gateway puts on every request for this deployment: no other caller of the
        # worker's request plane gets an answer.
        request_secret=settings.dynamo_request_secret(spec.workflow_id),
        # Requests wait at the worker's gate until it holds the deployment's weights.
        gated=True,
        **options,
    )


async def _start_runtime(
    settings: Settings, spec: ReplicaSpec, engine: EngineProcess, model_dir: Path, s3: Any, workdir: Path, backend: str
) -> ReplicaRuntime:
    """The started engine labelled and mapped, the host copy loaded (in shared memory: the engine
    takes its roll-back bytes from it), caught up to the deployment's snapshot when asked, then
    opened to requests."""
    if spec.joining:
        await engine.hold_out()  # no new request until the deployment serves it (`serve_replica`)
    await engine.set_weight_version("initial")
    await log_weight_map(spec.name, engine)
    host_arena = StageArena()
    host = await asyncio.to_thread(lambda: HostWeights.load(model_dir, allocate=host_arena.allocate))
    runtime = ReplicaRuntime(
        name=spec.name,
        engine=engine,
        host=host,
        s3=s3,
        workdir=workdir,
        host_arena=host_arena,
        faults_home=settings.home_path,
        deployment=spec.deployment_id,
        peer_host=spec.node_address or settings.host,
        peer_backend=backend,
    )
    if spec.catch_up:
        # A replica (re)started after hot-loads serves their snapshot before it takes traffic.
        inp = ApplySnapshotInput.model_validate_json(spec.catch_up)
        result = await runtime.apply_from_bucket(inp)
        log.info(
            "caught up to %s (%d tensors, %d bytes from the bucket)",
            inp.identity,
            result.tensors_loaded,
            result.bytes_read_from_bucket,
        )
    await engine.open_gate()  # it holds the deployment's weights and their label
    return runtime


async def _serve(
    spec: ReplicaSpec,
    client: Any,
    deployment: Any,
    engine: EngineProcess,
    runtime: ReplicaRuntime,
    metrics: ReplicaMetrics,
    metrics_url: str,
) -> int:
    """Run the replica's Temporal worker on its own task queue, tell the deployment it is ready,
    and serve until SIGTERM (0) or the engine's death, reported to the deployment (1)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task_queue = names.replica_task_queue(spec.workflow_id, spec.name)
    peer = PeerActivities(runtime, metrics)
    replica_acts = ReplicaActivities(runtime, metrics)
    worker = Worker(
        client,
        task_queue=task_queue,
        activities=[
            replica_acts.apply_snapshot,
            replica_acts.serve_replica,
            replica_acts.drain_replica,
            peer.offer_to_peer,
            peer.send_to_peers,
            peer.stage_from_peer,
            peer.commit_peer_stage,
        ],
        # Heartbeats carry cancellation back: send them at least every second, not every 24 s.
        max_heartbeat_throttle_interval=timedelta(seconds=1),
    )
    async with worker:
        now = rfc3339(datetime.now(UTC))
        await deployment.signal(
            names.REPLICA_READY,
            ReplicaEndpoint(
                name=spec.name,
                zone=spec.zone,
                task_queue=task_queue,
                node=spec.node,
                engine_url=engine.public_url,
                engine_pid=engine.pid,
                agent_pid=os.getpid(),
                current_snapshot_identity=runtime.current_identity,
                started_at=now,
                transitioned_at=now,
                dynamo_worker=engine.dynamo_worker,
                dynamo_namespace=engine.dynamo_namespace,
                metrics_url=metrics_url,
            ),
        )
        metrics.serving(runtime.current_identity)
        metrics.state("READY")
        freeze_heap()  # the host copy's objects, one per tensor, and every module's
        log.info(
            "replica %s ready: engine %s (pid %d), queue %s, metrics %s",
            spec.name,
            engine.public_url,
            engine.pid,
            task_queue,
            metrics_url,
        )
        return await _until_stopped(spec.name, engine, stop, deployment, metrics)


async def _until_stopped(
    name: str, engine: EngineProcess, stop: asyncio.Event, deployment: Any, metrics: ReplicaMetrics
) -> int:
    """0 once `stop` is set; 1 when the engine's process exits first (reported to the deployment)."""
    while not stop.is_set():
        if not engine.alive():
            reason = f"engine process {engine.pid} exited; log {engine.log_path}"
            log.error(reason)
            metrics.state("FAILED")
            with contextlib.suppress(Exception):
                await deployment.signal(names.REPLICA_FAILED, ReplicaFailure(name=name, reason=reason))
            return 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
    return 0
