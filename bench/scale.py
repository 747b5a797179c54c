"""Benchmark: the control plane at scale, with SIMULATED replicas (replica/simulated/).

The real embedded stack (Temporal dev server, SeaweedFS, API, control worker, gateway) without
a real node agent; instead `--nodes` SIMULATED node agents (`rollouts sim-node`, many simulated
replicas per process: no engine, they stage, swap, prove and report like an agent, and read the
bucket for real when a step reads it). A deployment of `--replicas` replicas is created through
the API, then a FULL hot-load and a delta hot-load run through the real workflows. For each it
prints:

- create → terminal state, seconds;
- history events and bytes of the hot-load workflow, of its stage groups (child workflows, one
  per `replicasPerGroup` receivers: their sum and the largest), of the deployment workflow and of
  the node registry;
- transfer rounds: the largest `peerRound` of any replica (the depth of the fan-out tree);
- the most activities pending at once in the hot-load workflow (sampled every 0.5 s);
- API latency while it runs: p50/p99 of `GET /hotLoads/{id}` and of the list (first page),
  from one client polling both every `--poll-s` (a dashboard's cadence; back to back, a faster
  API would only mean more load); `--describe-baseline`: beside it, at the same cadence,
  Temporal's own describe of the hot-load (what the API's GET of a running one cost when each
  GET waited for its describe, before api/open_reads.py); how many GETs were answered from the
  last describe because theirs was late; and how long after the hot-load's `finishedAt` the GET
  showed its end, and the describe;
- CPU seconds of each control-plane process (Temporal, API, control worker) during it;
- the replicas' sources (bucket / peer) and the largest pause.

`--autoscale N` then scales the deployment out by N replicas and back in (its `autoscaling.max`
is `--replicas` + N, both durations 0): the bench signals the deployment workflow `load_report`
BUSY, then IDLE, as a gateway does, from a SIMULATED gateway (`bench-simulated-load`: no request
reaches a SIMULATED replica, so no real gateway could judge its load). It prints the serving count
as it changed (polled every 0.2 s, so two quick steps may show as one change), how each joiner took the current snapshot
(the deployment's `stage_from_peer` / `commit_peer_stage` against `apply_snapshot` activities) and
the deployment's history growth.

    .venv/bin/python bench/scale.py --replicas 100
    .venv/bin/python bench/scale.py --replicas 1000 --nodes 4
    .venv/bin/python bench/scale.py --replicas 1000 --nodes 4 --max-concurrent-swaps 16
    .venv/bin/python bench/scale.py --replicas 1000 --nodes 4 --autoscale 3

`--fan-out`, `--group-size` and `--max-concurrent-swaps` set the deployment's `hotLoad.peerFanOut`,
`replicasPerGroup` and `maxConcurrentSwaps`. In a real deployment every replica agent runs on its
own host, not beside the control plane; `--sim-nice 19` runs the simulated agents at the lowest
CPU priority so that, on one machine, they take only what the control plane leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_kit import Api, deployment_body, stack_running  # noqa: E402  (bench/, beside this file)

from common.settings import Settings, temporal_client  # noqa: E402
from contracts import names  # noqa: E402
from contracts.autoscaling import BUSY, IDLE, LoadReport  # noqa: E402
from contracts.records import TERMINAL_HOT_LOAD_STATES  # noqa: E402
from rollouts.client import hot_load_body  # noqa: E402
from snapshots.synthetic import make_checkpoint_pair  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402
from tests.helpers.prometheus import scrape  # noqa: E402
from tests.helpers.sim_nodes import start_sim_node  # noqa: E402
from tests.helpers.stack_fixtures import free_port_base, wait_registered  # noqa: E402
from workers.stack import Stack, upload_dir  # noqa: E402

SIMULATED_GATEWAY = "bench-simulated-load"
# The activities a joiner's catch-up runs on the deployment workflow (control/autoscaler.py).
JOIN_STEPS = (
    names.STAGE_FROM_PEER,
    names.COMMIT_PEER_STAGE,
    names.APPLY_SNAPSHOT,
    names.SERVE_REPLICA,
    names.DRAIN_REPLICA,
)
CONTROL_PLANE = ("temporal", "api", "worker")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_reads(settings: Settings) -> dict[str, float]:
    """The API's `rollouts_api_open_hot_load_reads_total` by answer (api/metrics.py)."""
    samples = scrape(f"{settings.api_url}/metrics")
    return {
        dict(labels)["answer"]: v
        for (name, labels), v in samples.items()
        if name == "rollouts_api_open_hot_load_reads_total"
    }


def control_plane_cpu(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of each control-plane process."""
    return {name: cpu_seconds(pid) for name in CONTROL_PLANE if (pid := stack.pid_file(name).alive_pid())}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def history(settings: Settings, workflow_id: str) -> tuple[int, int]:
    client = await temporal_client(settings)
    info = (await client.get_workflow_handle(workflow_id).describe()).raw_description.workflow_execution_info
    return info.history_length, info.history_size_bytes


async def history_breakdown(settings: Settings, workflow_id: str, top: int = 6, run_id: str | None = None) -> str:
    """Where a workflow's history bytes went: the event types (and for activities and signals, their
    names) with the most bytes."""
    client = await temporal_client(settings)
    sizes: dict[str, list[int]] = {}
    names_by_id: dict[int, str] = {}
    async for event in client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history_events():
        kind = event.WhichOneof("attributes").removesuffix("_event_attributes")
        attrs = getattr(event, event.WhichOneof("attributes"))
        if kind == "activity_task_scheduled":
            names_by_id[event.event_id] = attrs.activity_type.name
        name = (
            getattr(getattr(attrs, "activity_type", None), "name", "")
            or getattr(attrs, "signal_name", "")
            or names_by_id.get(getattr(attrs, "scheduled_event_id", 0), "")
        )
        key = f"{kind}:{name}" if name else kind
        sizes.setdefault(key, [0, 0])
        sizes[key][0] += 1
        sizes[key][1] += event.ByteSize()
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1][1])[:top]
    return ", ".join(f"{k} {n}x {b / 1e6:.2f} MB" for k, (n, b) in ranked)


async def group_histories(settings: Settings, workflow_id: str) -> list[tuple[int, int]]:
    """(events, bytes) of each stage group of the hot-load `workflow_id`, in group order."""
    client = await temporal_client(settings)
    out = []
    while True:
        try:
            desc = await client.get_workflow_handle(names.stage_group_workflow_id(workflow_id, len(out))).describe()
        except Exception:  # noqa: BLE001 - no such group: that was the last
            return out
        info = desc.raw_description.workflow_execution_info
        out.append((info.history_length, info.history_size_bytes))


async def pending_activities(settings: Settings, workflow_id: str) -> int:
    client = await temporal_client(settings)
    return len((await client.get_workflow_handle(workflow_id).describe()).raw_description.pending_activities)


async def activity_counts(settings: Settings, workflow_id: str, types: tuple[str, ...]) -> dict[str, int]:
    """How many activities of each type the workflow's current run scheduled."""
    client = await temporal_client(settings)
    counts = dict.fromkeys(types, 0)
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            kind = event.activity_task_scheduled_event_attributes.activity_type.name
            if kind in counts:
                counts[kind] += 1
    return counts


def run_autoscale(settings: Settings, api: Api, dep_id: str, low: int, high: int) -> dict:
    """Scale from `low` to `high` serving replicas on BUSY reports, then back on IDLE ones, from
    the SIMULATED gateway; each step's seconds (a direction that stalls 10 min gives up), and how
    the joiners caught up."""
    workflow_id = names.deployment_workflow_id(settings.organization_id, dep_id)
    events0, _ = asyncio.run(history(settings, workflow_id))

    async def say(level: str) -> None:
        client = await temporal_client(settings)
        await client.get_workflow_handle(workflow_id).signal(
            names.LOAD_REPORT, LoadReport(gateway_id=SIMULATED_GATEWAY, level=level)
        )

    trace: list[tuple[str, float, int]] = []  # (level, seconds since it was first said, ready replicas)

    def steps(level: str, goal: int) -> list[float]:
        asyncio.run(say(level))
        took: list[float] = []
        first = t = said = time.perf_counter()
        deadline = t + 600
        serving = ready_replicas(api, dep_id)
        while serving != goal and time.perf_counter() < deadline:
            if time.perf_counter() - said > 20:  # a gateway's heartbeat: a report older than 90 s counts for nothing
                asyncio.run(say(level))
                said = time.perf_counter()
            time.sleep(0.2)
            now = ready_replicas(api, dep_id)
            if now != serving:
                trace.append((level, round(time.perf_counter() - first, 2), now))
                took.append(time.perf_counter() - t)
                t, serving = time.perf_counter(), now
        return took

    out_s = steps(BUSY, high)
    in_s = steps(IDLE, low)
    counts = asyncio.run(activity_counts(settings, workflow_id, JOIN_STEPS))
    events1, size1 = asyncio.run(history(settings, workflow_id))
    return {
        "out_s": out_s,
        "in_s": in_s,
        "trace": trace,
        "activities": counts,
        "history_events_added": events1 - events0,
        "deployment_history_bytes": size1,
    }


def ready_replicas(api: Api, dep_id: str) -> int:
    return int(api.call("GET", f"/deployments/{dep_id}")["deployment"]["status"].get("readyReplicas") or 0)


def time_describes(
    settings: Settings,
    workflow_id: str,
    done: threading.Event,
    out: list[float],
    seen_end: list[datetime],
    interval_s: float,
) -> None:
    """Temporal's own describe of the workflow at the reader's cadence until `done`, in ms: what
    the API's GET of a running hot-load cost when each GET described it (the baseline beside the
    API's figure); `seen_end` gets the time a describe first showed the hot-load's end."""

    async def run() -> None:
        handle = (await temporal_client(settings)).get_workflow_handle(workflow_id)
        while not done.is_set():
            t = time.perf_counter()
            try:
                desc = await handle.describe()
            except Exception:  # noqa: BLE001 - not started yet
                await asyncio.sleep(0.05)
                continue
            state = (await desc.memo_value("hotLoad"))["status"]["state"]
            out.append((time.perf_counter() - t) * 1000)
            if state in TERMINAL_HOT_LOAD_STATES and not seen_end:
                seen_end.append(datetime.now(timezone.utc))
            await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - t)))

    asyncio.run(run())


def sample_pending(settings: Settings, workflow_id: str, done: threading.Event, most: list[int]) -> None:
    """Until `done`, every 0.5 s: the most activities pending at once in the workflow (`most[0]`)."""
    while not done.is_set():
        try:
            most[0] = max(most[0], asyncio.run(pending_activities(settings, workflow_id)))
        except Exception:  # noqa: BLE001 - not started yet, or closed
            pass
        done.wait(0.5)


def poll_until_terminal(
    reader: Api, identity: str, dep_id: str, poll_s: float, get_ms: list[float], list_ms: list[float]
) -> tuple[dict, datetime]:
    """A dashboard's reader: GET the hot-load and list the deployment's, every `poll_s` (start to
    start), timing each, until the GET shows a terminal state; that answer and when it came."""
    while True:
        t = begun = time.perf_counter()
        hl = reader.call("GET", f"/hotLoads/{identity}")["hotLoad"]
        get_ms.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        reader.call("GET", "/hotLoads", params={"parentDeploymentId": dep_id, "maxPageSize": 50})
        list_ms.append((time.perf_counter() - t) * 1000)
        if hl["status"]["state"] in TERMINAL_HOT_LOAD_STATES:
            return hl, datetime.now(timezone.utc)
        time.sleep(max(0.0, poll_s - (time.perf_counter() - begun)))  # a client polling at a cadence


def all_replicas(reader: Api, identity: str) -> list[dict]:
    """Every page of the hot-load's replica list."""
    replicas: list[dict] = []
    token = None
    while True:
        page = reader.call(
            "GET",
            f"/hotLoads/{identity}/replicas",
            params={"maxPageSize": 1000, **({"pageToken": token} if token else {})},
        )
        replicas += page["replicas"]
        if not (token := page.get("nextPageToken")):
            return replicas


def history_figures(settings: Settings, workflow_id: str, dep_id: str) -> dict:
    """History events and bytes of the hot-load, its stage groups, the deployment and the registry."""
    events, size = asyncio.run(history(settings, workflow_id))
    groups = asyncio.run(group_histories(settings, workflow_id))
    dep_events, dep_size = asyncio.run(
        history(settings, names.deployment_workflow_id(settings.organization_id, dep_id))
    )
    reg_events, reg_size = asyncio.run(history(settings, names.NODE_REGISTRY_ID))
    return {
        "history_events": events,
        "history_bytes": size,
        "stage_groups": len(groups),
        "group_history_events_sum": sum(e for e, _ in groups),
        "group_history_events_max": max((e for e, _ in groups), default=0),
        "group_history_bytes_max": max((b for _, b in groups), default=0),
        "deployment_history_events": dep_events,
        "deployment_history_bytes": dep_size,
        "registry_history_events": reg_events,
        "registry_history_bytes": reg_size,
    }


def replica_sources(replicas: list[dict]) -> dict[str, int]:
    """How many replicas took the snapshot from each kind of source (bucket, peer)."""
    sources: dict[str, int] = {}
    for r in replicas:
        kind = (r.get("source") or "?").split(":")[0]
        sources[kind] = sources.get(kind, 0) + 1
    return sources


def run_hot_load(
    settings: Settings,
    stack: Stack,
    api: Api,
    dep_id: str,
    identity: str,
    previous: str | None,
    describe_baseline: bool = False,
    poll_s: float = 0.05,
) -> dict:
    body = hot_load_body(dep_id, identity, previous_identity=previous, hot_load_id=identity)
    get_ms: list[float] = []
    list_ms: list[float] = []
    most_pending = [0]
    workflow_id = names.hot_load_workflow_id(settings.organization_id, identity)
    done = threading.Event()
    reads0 = open_reads(settings)
    cpu0, t0 = control_plane_cpu(stack), time.perf_counter()
    api.call("POST", "/hotLoads", json=body)
    sampler = threading.Thread(target=sample_pending, daemon=True, args=(settings, workflow_id, done, most_pending))
    sampler.start()
    describe_ms: list[float] = []
    describe_end: list[datetime] = []
    describer = threading.Thread(
        target=time_describes, daemon=True, args=(settings, workflow_id, done, describe_ms, describe_end, poll_s)
    )
    if describe_baseline:
        describer.start()
    reader = Api(settings)
    hl, seen_end = poll_until_terminal(reader, identity, dep_id, poll_s, get_ms, list_ms)
    seconds, cpu1 = time.perf_counter() - t0, control_plane_cpu(stack)
    reads = {k: v - reads0.get(k, 0.0) for k, v in open_reads(settings).items()}
    finished = datetime.fromisoformat(hl["status"]["finishedAt"].replace("Z", "+00:00"))
    cpu = {name: cpu1[name] - cpu0.get(name, 0.0) for name in cpu1}
    done.set()
    sampler.join()
    if describe_baseline:
        describer.join(timeout=30)
    replicas = all_replicas(reader, identity)
    return {
        "identity": identity,
        "state": hl["status"]["state"],
        "seconds": seconds,
        "replicas": len(replicas),
        "ready": sum(r["state"] == "READY" for r in replicas),
        "most_pending_activities": most_pending[0],
        "transfer_rounds": max((r.get("peerRound") or 0 for r in replicas), default=0),
        **history_figures(settings, workflow_id, dep_id),
        "api_get_p50_ms": pct(get_ms, 0.5),
        "api_get_p99_ms": pct(get_ms, 0.99),
        "api_list_p50_ms": pct(list_ms, 0.5),
        "api_list_p99_ms": pct(list_ms, 0.99),
        "api_samples": len(get_ms),
        "describe_p50_ms": pct(describe_ms, 0.5),
        "describe_p99_ms": pct(describe_ms, 0.99),
        "describe_samples": len(describe_ms),
        "end_seen_after_ms": (seen_end - finished).total_seconds() * 1000,
        "gets_described": reads.get("described", 0.0),
        "gets_kept": reads.get("kept", 0.0),
        "describe_end_seen_after_ms": (describe_end[0] - finished).total_seconds() * 1000 if describe_end else None,
        "control_plane_cpu_s": sum(cpu.values()),
        "cpu_s_by_process": cpu,
        "sources": replica_sources(replicas),
        "max_pause_ms": max((r.get("pauseMs") or 0 for r in replicas), default=0),
        "condition": (hl["status"].get("conditions") or [{}])[-1].get("message", ""),
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=2, help="SIMULATED node agent processes")
    ap.add_argument("--transfer-ms", type=float, default=50.0, help="simulated peer transfer time")
    ap.add_argument("--fan-out", type=int, default=4, help="hotLoad.peerFanOut")
    ap.add_argument("--group-size", type=int, default=100, help="hotLoad.replicasPerGroup")
    ap.add_argument("--max-concurrent-swaps", type=int, default=1, help="hotLoad.maxConcurrentSwaps")
    ap.add_argument(
        "--sim-nice",
        type=int,
        default=0,
        help="run the SIMULATED node agents at this niceness (19: they take only the CPU the control "
        "plane leaves, as agents on their own hosts would)",
    )
    ap.add_argument(
        "--autoscale",
        type=int,
        default=0,
        help="after the hot-loads, scale out by this many replicas and back in (SIMULATED load reports)",
    )
    ap.add_argument(
        "--describe-baseline",
        action="store_true",
        help="also time Temporal's own describe of the hot-load back to back (adds that load)",
    )
    ap.add_argument(
        "--poll-s",
        type=float,
        default=0.05,
        help="the reader's cadence: a GET and a list every this many seconds (start to start)",
    )
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--deployment-only", action="store_true", help="create the deployment, report, and stop")
    ap.add_argument("--keep", action="store_true", help="keep the stack's home (logs) afterwards")
    return ap.parse_args()


def publish_checkpoints(settings: Settings, work: Path) -> None:
    """A 1 MB synthetic base (`full-0`) and its delta (`delta-1`), uploaded under scale/ckpt."""
    base, new = work / "base", work / "new"
    make_checkpoint_pair(base, new, size_mb=1, seed=0)
    write_delta(base, new, work / "delta", version="delta-1", base_version="full-0")
    s3 = settings.s3_client()
    upload_dir(s3, base, settings.bucket, "scale/ckpt/full-0")
    upload_dir(s3, work / "delta", settings.bucket, "scale/ckpt/delta-1")


def create_deployment(settings: Settings, api: Api, args: argparse.Namespace) -> str:
    """The deployment of `--replicas` SIMULATED replicas; its id."""
    return api.call(
        "POST",
        "/deployments",
        json=deployment_body(
            settings,
            "scale",
            gpus=1,  # one simulated GPU each: placement puts them on the simulated nodes only
            autoscaling={
                "min": args.replicas,
                "max": args.replicas + args.autoscale,
                **({"scaleOutAfterSeconds": 0, "scaleInAfterSeconds": 0} if args.autoscale else {}),
            },
            hot_load={
                "pathPrefix": "scale/ckpt",
                "peerFanOut": args.fan_out,
                "replicasPerGroup": args.group_size,
                "maxConcurrentSwaps": args.max_concurrent_swaps,
            },
        ),
    )["deployment"]["spec"]["id"]


def wait_deployment(settings: Settings, api: Api, dep_id: str, replicas: int) -> dict | None:
    """The deployment once READY or FAILED; None (said how) when its workflow closed first."""
    while True:
        r = api.http.get(f"/deployments/{dep_id}")
        if r.status_code != 200:  # the deployment workflow closed: say how
            events, size = asyncio.run(
                history(settings, names.deployment_workflow_id(settings.organization_id, dep_id))
            )
            print(
                f"deployment of {replicas} replicas: GET answers {r.status_code}; its workflow closed after "
                f"{events} history events, {size / 1e6:.1f} MB (Temporal ends a workflow past 50 MB / 51,200 "
                "events)"
            )
            print(
                "  "
                + asyncio.run(
                    history_breakdown(settings, names.deployment_workflow_id(settings.organization_id, dep_id))
                )
            )
            return None
        dep = r.json()["deployment"]
        if dep["status"]["status"] in ("STATUS_READY", "STATUS_FAILED"):
            return dep
        time.sleep(1)


def print_runs(settings: Settings, dep_wf: str) -> None:
    """The history breakdown of each run of the deployment workflow (`--deployment-only`)."""

    async def runs() -> list[str]:
        client = await temporal_client(settings)
        return [wf.run_id async for wf in client.list_workflows(f"WorkflowId = '{dep_wf}'")]

    for run in asyncio.run(runs()):
        print(f"  run {run}: {asyncio.run(history_breakdown(settings, dep_wf, run_id=run))}")


def print_hot_load(r: dict, args: argparse.Namespace) -> None:
    print(
        f"\n{r['identity']}: {r['state']} in {r['seconds']:.1f} s; {r['ready']}/{r['replicas']} READY; "
        f"sources {r['sources']}; max pause {r['max_pause_ms']:.1f} ms"
    )
    print(
        f"  hot-load history      {r['history_events']} events, {r['history_bytes'] / 1e6:.2f} MB; "
        f"most pending activities {r['most_pending_activities']}"
    )
    print(
        f"  stage groups          {r['stage_groups']}: {r['group_history_events_sum']} events in all, at most "
        f"{r['group_history_events_max']} ({r['group_history_bytes_max'] / 1e6:.2f} MB) in one"
    )
    print(f"  transfer rounds       {r['transfer_rounds']} (fan-out {args.fan_out}, k = {args.max_concurrent_swaps})")
    print(
        f"  deployment history    {r['deployment_history_events']} events, {r['deployment_history_bytes'] / 1e6:.2f} MB"
    )
    print(f"  node registry history {r['registry_history_events']} events, {r['registry_history_bytes'] / 1e6:.2f} MB")
    print(
        f"  API GET p50/p99 {r['api_get_p50_ms']:.1f}/{r['api_get_p99_ms']:.1f} ms, list p50/p99 "
        f"{r['api_list_p50_ms']:.1f}/{r['api_list_p99_ms']:.1f} ms ({r['api_samples']} samples)"
    )
    print(
        f"  its end shown by GET  {r['end_seen_after_ms']:.0f} ms after the hot-load's finishedAt; GETs "
        f"answered by their describe {r['gets_described']:.0f}, from the last one (theirs late) "
        f"{r['gets_kept']:.0f}"
    )
    if r["describe_samples"]:
        end = r["describe_end_seen_after_ms"]
        print(
            f"  Temporal describe p50/p99 {r['describe_p50_ms']:.1f}/{r['describe_p99_ms']:.1f} ms "
            f"({r['describe_samples']} samples, beside the API's); its end shown by describe "
            + (f"{end:.0f} ms after finishedAt" if end is not None else "never")
        )
    print(
        f"  control-plane CPU     {r['control_plane_cpu_s']:.1f} s ("
        + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_s_by_process"].items())
        + f") in {r['seconds']:.0f} s"
    )
    if r["state"] != "HOT_LOAD_STATE_COMPLETED":
        print(f"  condition: {r['condition']}")


def print_autoscale(scaled: dict, args: argparse.Namespace) -> None:
    print(
        f"\nautoscaling {args.replicas} -> {args.replicas + args.autoscale} -> {args.replicas} "
        f"(SIMULATED gateway load reports)"
    )
    print("  scale-out, s between changes of the serving count: " + ", ".join(f"{x:.1f}" for x in scaled["out_s"]))
    print("  scale-in, s between changes of the serving count:  " + ", ".join(f"{x:.1f}" for x in scaled["in_s"]))
    print(f"  ready replicas as they changed (level, s, count): {scaled['trace']}")
    print(f"  deployment activities {scaled['activities']}")
    print(
        f"  deployment history +{scaled['history_events_added']} events "
        f"({scaled['deployment_history_bytes'] / 1e6:.2f} MB now)"
    )


def all_passed(results: list[dict], scaled: dict | None, args: argparse.Namespace) -> bool:
    """Every hot-load COMPLETED and, with `--autoscale`, the serving count reached the top and came back."""
    scaled_ok = not args.autoscale or (
        scaled is not None
        and max(n for _, _, n in scaled["trace"]) == args.replicas + args.autoscale
        and scaled["trace"][-1][2] == args.replicas
    )
    return all(r["state"] == "HOT_LOAD_STATE_COMPLETED" for r in results) and scaled_ok


def measure(settings: Settings, stack: Stack, api: Api, dep_id: str, args: argparse.Namespace) -> int:
    """The FULL and the delta hot-load, then `--autoscale`'s out and in; printed (and `--json`)."""
    results = [
        run_hot_load(settings, stack, api, dep_id, "full-0", None, args.describe_baseline, args.poll_s),
        run_hot_load(settings, stack, api, dep_id, "delta-1", "full-0", args.describe_baseline, args.poll_s),
    ]
    for r in results:
        print_hot_load(r, args)
    scaled: dict | None = None
    if args.autoscale and all(r["state"] == "HOT_LOAD_STATE_COMPLETED" for r in results):
        scaled = run_autoscale(settings, api, dep_id, args.replicas, args.replicas + args.autoscale)
        print_autoscale(scaled, args)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "replicas": args.replicas,
                    "nodes": args.nodes,
                    "fan_out": args.fan_out,
                    "group_size": args.group_size,
                    "k": args.max_concurrent_swaps,
                    "sim_nice": args.sim_nice,
                    "autoscale": scaled,
                    "results": results,
                },
                indent=1,
            )
        )
    return 0 if all_passed(results, scaled, args) else 1


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    settings = Settings.create(work / "home", free_port_base())
    with stack_running(settings, node_slots=0, keep=args.keep, many_pollers=True) as (stack, nodes):
        per_node = -(-(args.replicas + args.autoscale) // args.nodes)
        for i in range(args.nodes):
            nodes.append(
                start_sim_node(
                    settings, f"sim-{i}", per_node, "--transfer-ms", str(args.transfer_ms), nice=args.sim_nice
                )
            )
        publish_checkpoints(settings, work)
        api = Api(settings)
        for i in range(args.nodes):
            wait_registered(settings, f"sim-{i}")
        t0 = time.perf_counter()
        dep_id = create_deployment(settings, api, args)
        dep = wait_deployment(settings, api, dep_id, args.replicas)
        if dep is None:
            return 1
        print(
            f"deployment of {args.replicas} SIMULATED replicas on {args.nodes} simulated node(s) (nice "
            f"{args.sim_nice}): {dep['status']['status']} in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        dep_wf = names.deployment_workflow_id(settings.organization_id, dep_id)
        events, size = asyncio.run(history(settings, dep_wf))
        print(
            f"  deployment history {events} events, {size / 1e6:.2f} MB: "
            f"{asyncio.run(history_breakdown(settings, dep_wf))}",
            flush=True,
        )
        if args.deployment_only:
            print_runs(settings, dep_wf)
            return 0
        if dep["status"]["status"] != "STATUS_READY":
            print(json.dumps(dep["status"], indent=1))
            return 1
        return measure(settings, stack, api, dep_id, args)


if __name__ == "__main__":
    sys.exit(main())
