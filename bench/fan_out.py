"""Benchmark: the fan-out against the single-group broadcast, side by side in one run, on real
vLLM CPU replicas (Dynamo workers) of the embedded stack.

    .venv/bin/python bench/fan_out.py [--replicas 6] [--size-mb 64] [--fan-out 2] [--runs 2]

Builds a Llama-shaped BF16 model of about `--size-mb` MiB and one realistic RL step of it
(`snapshots.synthetic`), starts the stack, and for each way of passing the update on creates a
deployment of `--replicas` replicas, runs `--runs` delta hot-loads (each after a FULL one that
sets the base, not timed), and deletes it:

- broadcast: `hotLoad.peerFanOut` = replicas - 1: the first replica sends to every other one in
  one group (what the walk did before the fan-out);
- fan-out: `hotLoad.peerFanOut` = `--fan-out`: replicas that staged pass the update on.

For each it prints the delta hot-load's seconds (create to COMPLETED), the staging span (the
first `stage_from_peer` scheduled to the last one closed, from the Temporal history), the rounds
(the largest `peerRound`), the most receivers one sender served, and where each replica's
update came from; then the ratios against the broadcast.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_kit import give_base_tokenizer, stack_in  # noqa: E402  (bench/, beside this file)

from common.settings import Settings, temporal_client  # noqa: E402
from contracts import names  # noqa: E402
from snapshots.synthetic import make_checkpoint_pair  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402
from tests.helpers.deployments import delete_deployment  # noqa: E402
from tests.helpers.replicas import hot_load, hot_load_replicas  # noqa: E402
from tests.helpers.stack_fixtures import Api  # noqa: E402
from workers.stack import upload_dir  # noqa: E402


async def staging_span(settings: Settings, hot_load_id: str) -> float:
    """Seconds from the first `stage_from_peer` scheduled to the last one closed."""
    client = await temporal_client(settings)
    handle = client.get_workflow_handle(names.hot_load_workflow_id(settings.organization_id, hot_load_id))
    scheduled: dict[int, float] = {}
    first, last = float("inf"), 0.0
    async for event in handle.fetch_history_events():
        at = event.event_time.ToDatetime().timestamp()
        if event.HasField("activity_task_scheduled_event_attributes"):
            if event.activity_task_scheduled_event_attributes.activity_type.name == names.STAGE_FROM_PEER:
                scheduled[event.event_id] = at
                first = min(first, at)
        for kind in ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes"):
            if event.HasField(kind) and getattr(event, kind).scheduled_event_id in scheduled:
                last = max(last, at)
    return last - first if scheduled else float("nan")


def measure(settings: Settings, api: Api, work: Path, label: str, replicas: int, fan_out: int, runs: int) -> dict:
    body = {
        "name": f"fan-{label}",
        "gatewayIds": [settings.gateway_id],
        "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
        "model": {"name": f"fan-{label}", "bucket": settings.bucket, "path": "bench/model"},
        "autoscaling": {"min": replicas, "max": replicas},
        "hotLoad": {"bucket": settings.bucket, "pathPrefix": f"bench/{label}", "peerFanOut": fan_out},
    }
    t0 = time.monotonic()
    dep_id = api.call("POST", "/deployments", json=body).json()["deployment"]["spec"]["id"]
    dep = api.wait_deployment(dep_id, timeout=1800)
    assert dep["status"]["status"] == "STATUS_READY", dep["status"]
    print(f"{label}: {replicas} replicas READY in {time.monotonic() - t0:.0f} s (peerFanOut {fan_out})", flush=True)
    s3 = settings.s3_client()
    out: dict = {"label": label, "fan_out": fan_out, "seconds": [], "staging": [], "rounds": 0, "widest": 0}
    try:
        for run in range(runs):
            upload_dir(s3, work / "base", settings.bucket, f"bench/{label}/base-{run}")
            upload_dir(s3, work / "delta", settings.bucket, f"bench/{label}/step-{run}")
            hot_load(api, dep_id, f"base-{run}", None)
            t = time.monotonic()
            hl = hot_load(api, dep_id, f"step-{run}", f"base-{run}")
            seconds = time.monotonic() - t
            assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
            reps = hot_load_replicas(api, hl["spec"]["id"])
            span = asyncio.run(staging_span(settings, hl["spec"]["id"]))
            senders = [r["source"] for r in reps if r["source"].startswith("peer:")]
            out["seconds"].append(seconds)
            out["staging"].append(span)
            out["rounds"] = max(out["rounds"], max((r.get("peerRound") or 0 for r in reps), default=0))
            out["widest"] = max(out["widest"], max((senders.count(s) for s in set(senders)), default=0))
            print(
                f"  {label} run {run}: {seconds:.2f} s, staging {span:.2f} s; sources "
                f"{[r['source'] for r in reps]}; rounds {[r.get('peerRound') for r in reps]}",
                flush=True,
            )
    finally:
        delete_deployment(api, dep_id, timeout=600)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=6)
    ap.add_argument("--size-mb", type=float, default=64)
    ap.add_argument("--fan-out", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the stack's home (logs) afterwards")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-fan-out-"))
    info = make_checkpoint_pair(work / "base", work / "new", size_mb=args.size_mb, seed=0)
    with stack_in(work, keep=args.keep) as (_, settings):
        give_base_tokenizer(settings, work / "base", work / "new")
        stats = write_delta(work / "base", work / "new", work / "delta", version="1", base_version="0")
        print(
            f"model {info['tensor_bytes'] / 2**20:.0f} MiB BF16; delta {stats.wire_bytes / 2**20:.1f} MiB", flush=True
        )
        upload_dir(settings.s3_client(), work / "base", settings.bucket, "bench/model")
        api = Api(settings)
        results = [
            measure(settings, api, work, "broadcast", args.replicas, args.replicas - 1, args.runs),
            measure(settings, api, work, "fanout", args.replicas, args.fan_out, args.runs),
        ]
        print()
        base = results[0]
        for r in results:
            hot, span = statistics.median(r["seconds"]), statistics.median(r["staging"])
            print(
                f"{r['label']:10s} peerFanOut {r['fan_out']:2d}: delta hot-load median {hot:.2f} s "
                f"({statistics.median(base['seconds']) / hot:.2f}x the broadcast's speed), staging median "
                f"{span:.2f} s, rounds {r['rounds']}, at most {r['widest']} receivers served by one sender"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
