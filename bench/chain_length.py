"""Benchmark: does a delta hot-load get slower as its snapshot chain grows?

The real embedded stack (Temporal dev server, SeaweedFS, API, control worker) with one SIMULATED
node agent (`rollouts sim-node`, replica/simulated/: no engine; each replica reads the new link
from the bucket for real, stages, swaps and reports like an agent). One deployment of
`--replicas` replicas; `--chains` times over on it, a FULL hot-load then `--deltas` deltas, each on
the one before (chain positions 1..N; every delta is the same small real delta, uploaded under
its own identity). Each hot-load is created through the REST API and polled until COMPLETED.

With `--engine`, the replica is a real Dynamo vLLM worker on CPU (the stack's own node agent, its
generated base model) and the chain is real: each delta is one training step on the one before
(`tests/helpers/trainer.train_step`, four tensors), written with our delta writer, so every
hot-load stages, swaps and proves real bytes.

It prints create → COMPLETED per chain position (the median over the chains), the medians of
each block of ten positions, position N against position 2 (the side-by-side baseline: same
deployment, same run), the least-squares slope over all positions, the last five positions
against positions 2–6, and how many snapshot
checks (`check_snapshot_files` activities) the deployment's admission scheduled at positions 1,
2, N/2 and N (read from every run of the deployment workflow's history at the end).

    .venv/bin/python bench/chain_length.py --deltas 60 --chains 3
    .venv/bin/python bench/chain_length.py --deltas 60 --chains 2 --engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_kit import Api, deployment_body, stack_running  # noqa: E402  (bench/, beside this file)

from common.settings import Settings, temporal_client  # noqa: E402
from contracts import names  # noqa: E402
from contracts.records import TERMINAL_HOT_LOAD_STATES  # noqa: E402
from rollouts.client import hot_load_body  # noqa: E402
from snapshots.chain import MAX_CHAIN_DELTAS  # noqa: E402
from snapshots.synthetic import make_checkpoint_pair  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402
from tests.helpers.sim_nodes import start_sim_node  # noqa: E402
from tests.helpers.stack_fixtures import free_port_base, wait_registered  # noqa: E402
from tests.helpers.trainer import train_step  # noqa: E402
from workers.stack import LOCAL_NODE, upload_dir  # noqa: E402

PREFIX = "chain/ckpt"


async def checks_by_hot_load(settings: Settings, dep_id: str) -> dict[str, int]:
    """hot-load id -> the `check_snapshot_files` activities its admission scheduled, from every
    run of the deployment workflow (it continues as new as its history grows)."""
    client = await temporal_client(settings)
    workflow_id = names.deployment_workflow_id(settings.organization_id, dep_id)
    counts: dict[str, int] = {}
    async for run in client.list_workflows(f"WorkflowId = '{workflow_id}'"):
        current: str | None = None
        async for event in client.get_workflow_handle(workflow_id, run_id=run.run_id).fetch_history_events():
            if event.HasField("workflow_execution_update_accepted_event_attributes"):
                request = event.workflow_execution_update_accepted_event_attributes.accepted_request
                if request.input.name == "create_hot_load":
                    current = json.loads(request.input.args.payloads[0].data)["hotLoadId"]
                    counts[current] = 0
            elif (
                current is not None
                and event.HasField("activity_task_scheduled_event_attributes")
                and event.activity_task_scheduled_event_attributes.activity_type.name == names.CHECK_SNAPSHOT
            ):
                counts[current] += 1
    return counts


def hot_load(api: Api, dep_id: str, identity: str, previous: str | None, poll_s: float) -> float:
    """create → COMPLETED seconds of one hot-load, through the API."""
    body = hot_load_body(dep_id, identity, previous_identity=previous, hot_load_id=identity)
    t0 = time.perf_counter()
    api.call("POST", "/hotLoads", json=body)
    while True:
        hl = api.call("GET", f"/hotLoads/{identity}")["hotLoad"]
        if hl["status"]["state"] in TERMINAL_HOT_LOAD_STATES:
            break
        time.sleep(poll_s)
    seconds = time.perf_counter() - t0
    if hl["status"]["state"] != "HOT_LOAD_STATE_COMPLETED":
        raise SystemExit(f"{identity}: {hl['status']['state']}: {hl['status'].get('conditions')}")
    return seconds  # the next create follows at once: a hot-load shown terminal is admitted past


def publish_real_chains(settings: Settings, work: Path, chains: int, deltas: int) -> None:
    """Training steps from the stack's base model, each a delta on the one before, uploaded as
    chain c's `c{c}-full` (the base) and `c{c}-d{i}` (the same steps, written under each chain's
    own identities)."""
    s3 = settings.s3_client()
    steps = [settings.home_path / "models" / "base"]
    for i in range(1, deltas + 1):
        steps.append(train_step(steps[-1], work / f"step-{i}", seed=1000 + i))
    for c in range(chains):
        upload_dir(s3, steps[0], settings.bucket, f"{PREFIX}/c{c}-full")
        for i in range(1, deltas + 1):
            out = work / f"c{c}-d{i}"
            write_delta(
                steps[i - 1],
                steps[i],
                out,
                version=f"c{c}-d{i}",
                base_version=f"c{c}-full" if i == 1 else f"c{c}-d{i - 1}",
            )
            upload_dir(s3, out, settings.bucket, f"{PREFIX}/c{c}-d{i}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deltas", type=int, default=60, help=f"chain positions 1..N (N <= {MAX_CHAIN_DELTAS})")
    ap.add_argument("--chains", type=int, default=3, help="chains hot-loaded one after the other (medians over them)")
    ap.add_argument("--replicas", type=int, default=1, help="SIMULATED replicas of the deployment")
    ap.add_argument("--poll-s", type=float, default=0.02, help="the client's GET cadence")
    ap.add_argument("--keep", action="store_true", help="keep the stack's home (logs) afterwards")
    ap.add_argument(
        "--engine",
        action="store_true",
        help="real Dynamo vLLM replica(s) on the stack's own node agent, and a real chain of training steps",
    )
    args = ap.parse_args()
    if not 2 <= args.deltas <= MAX_CHAIN_DELTAS:
        raise SystemExit(f"--deltas must be 2..{MAX_CHAIN_DELTAS}")
    return args


def publish_synthetic_chains(settings: Settings, work: Path, chains: int, deltas: int) -> None:
    """A 1 MB synthetic base and one delta, uploaded as every chain's `c{c}-full` and `c{c}-d{i}`."""
    s3 = settings.s3_client()
    base, new = work / "base", work / "new"
    make_checkpoint_pair(base, new, size_mb=1, seed=0)
    write_delta(base, new, work / "delta", version="d", base_version="full")
    for c in range(chains):
        upload_dir(s3, base, settings.bucket, f"{PREFIX}/c{c}-full")
        for i in range(1, deltas + 1):
            upload_dir(s3, work / "delta", settings.bucket, f"{PREFIX}/c{c}-d{i}")


def create_ready_deployment(settings: Settings, api: Api, replicas: int, engine: bool) -> str:
    """The bench's deployment, once READY; its id."""
    dep_id = api.call(
        "POST",
        "/deployments",
        json=deployment_body(
            settings,
            "chain",
            gpus=0 if engine else 1,
            autoscaling={"min": replicas, "max": replicas},
            hot_load={"pathPrefix": PREFIX},
        ),
    )["deployment"]["spec"]["id"]
    while (status := api.call("GET", f"/deployments/{dep_id}")["deployment"]["status"]["status"]) != "STATUS_READY":
        if status == "STATUS_FAILED":
            raise SystemExit("the deployment FAILED")
        time.sleep(0.5)
    return dep_id


def hot_load_chains(api: Api, dep_id: str, args: argparse.Namespace) -> list[list[float]]:
    """seconds[c][p]: chain c, position p (0: the full base), hot-loaded in order."""
    seconds: list[list[float]] = []
    for c in range(args.chains):
        row = []
        for p in range(args.deltas + 1):
            identity = f"c{c}-full" if p == 0 else f"c{c}-d{p}"
            previous = None if p == 0 else (f"c{c}-full" if p == 1 else f"c{c}-d{p - 1}")
            row.append(hot_load(api, dep_id, identity, previous, args.poll_s))
        seconds.append(row)
        print(
            f"chain {c + 1}/{args.chains}: position 2 {row[2]:.3f} s, position {args.deltas} {row[args.deltas]:.3f} s",
            flush=True,
        )
    return seconds


def report(seconds: list[list[float]], checks: dict[str, int], args: argparse.Namespace) -> None:
    """Medians over the chains per position, by tens, the end against the start, and the slope;
    the snapshot checks each admission scheduled."""
    median = [statistics.median(seconds[c][p] for c in range(args.chains)) for p in range(args.deltas + 1)]
    n = args.deltas
    kind = "real Dynamo vLLM" if args.engine else "SIMULATED"
    print(
        f"\n{args.replicas} {kind} replica(s), {args.chains} chain(s) of 1 full + {n} deltas on one "
        "deployment; create → COMPLETED, median over the chains:"
    )
    print("  per position: " + ", ".join(f"{p}: {median[p]:.3f}" for p in range(1, n + 1)))
    for lo in range(1, n + 1, 10):
        hi = min(n, lo + 9)
        print(f"  positions {lo:>2}–{hi:<2}  median {statistics.median(median[lo : hi + 1]):.3f} s")
    print(f"  position {n} {median[n]:.3f} s vs position 2 {median[2]:.3f} s: ratio {median[n] / median[2]:.3f}")
    slope, _ = statistics.linear_regression(range(1, n + 1), median[1:])
    print(
        f"  least-squares slope over positions 1–{n}: {slope * 1000:+.2f} ms per position "
        f"({slope * (n - 2) / median[2]:+.1%} of position 2 from 2 to {n})"
    )
    tail, head = statistics.median(median[n - 4 : n + 1]), statistics.median(median[2:7])
    print(f"  positions {n - 4}–{n} median {tail:.3f} s vs positions 2–6 {head:.3f} s: ratio {tail / head:.3f}")
    per_position = [[checks.get(f"c{c}-d{p}") for c in range(args.chains)] for p in range(n + 1)]
    print(
        "  snapshot checks per admission (each chain): "
        + ", ".join(f"position {p}: {per_position[p]}" for p in (1, 2, n // 2, n))
    )


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-chain-"))
    settings = Settings.create(work / "home", free_port_base())
    with stack_running(settings, node_slots=args.replicas if args.engine else 0, keep=args.keep) as (_, nodes):
        if args.engine:
            publish_real_chains(settings, work, args.chains, args.deltas)
        else:
            nodes.append(start_sim_node(settings, "sim-0", args.replicas))
            publish_synthetic_chains(settings, work, args.chains, args.deltas)
        api = Api(settings)
        wait_registered(settings, LOCAL_NODE if args.engine else "sim-0")
        dep_id = create_ready_deployment(settings, api, args.replicas, args.engine)
        seconds = hot_load_chains(api, dep_id, args)
        report(seconds, asyncio.run(checks_by_hot_load(settings, dep_id)), args)
        return 0


if __name__ == "__main__":
    sys.exit(main())
