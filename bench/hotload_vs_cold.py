"""Delta hot-load vs a cold rolling restart, side by side in one run, on the real stack.

    .venv/bin/python bench/hotload_vs_cold.py [--size-mb 256] [--replicas 4] [--runs 3] [--cold-runs 1] [--timeline]
        [--max-concurrent-swaps K]

Builds a Llama-shaped BF16 model of about `--size-mb` MiB and one realistic RL step of it (fp32
master, one Adam step at lr 1e-6: a few percent of elements change; `snapshots.synthetic`),
starts the embedded stack in a temporary home, and creates a `--replicas` deployment of it.

(a) hot-load: per run, a FULL hot-load of the base (setup, not timed), then the INCREMENTAL
    delta of the step, timed from create to COMPLETED through the REST API; the first replica
    reads the bucket, the others receive from a peer. `--max-concurrent-swaps` sets the
    deployment's `hotLoad.maxConcurrentSwaps` (1, the default: one replica at a time).
(b) cold path: per run, for each replica in turn (a rolling restart), stop a vLLM engine, fetch
    the new full checkpoint from the bucket, start vLLM on it and wait until it serves.

Prints the medians, (b)/(a), the per-replica pause window and bytes read from the bucket per
replica; `--timeline`: also when each activity of the last hot-load was scheduled, started and
closed (from its Temporal history), to see where the walk waits. Figures on a shared machine
are noisy: the ratio is the figure, not the seconds (measured figures: bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_kit import give_base_tokenizer, stack_in  # noqa: E402  (bench/, beside this file)

from common.processes import free_port  # noqa: E402
from common.settings import Settings  # noqa: E402
from contracts.names import hot_load_workflow_id  # noqa: E402
from contracts.records import TERMINAL_HOT_LOAD_STATES  # noqa: E402
from replica.agent.downloads import download_prefix  # noqa: E402
from replica.agent.engine_process import EngineProcess  # noqa: E402
from snapshots.synthetic import make_checkpoint_pair  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402
from tests.helpers.stack_fixtures import Api  # noqa: E402
from tests.helpers.temporal_server import TEMPORAL_BIN  # noqa: E402
from workers.stack import upload_dir  # noqa: E402


def hot_load(api: Api, dep_id: str, identity: str, previous: str | None) -> tuple[dict, float, float]:
    """Create a hot-load and wait until it ends; returns it, the seconds to COMPLETED, and the
    wall-clock time of the create call."""
    body: dict = {"deploymentId": dep_id, "identity": identity, "type": "SNAPSHOT_TYPE_FULL"}
    if previous:
        body["type"] = "SNAPSHOT_TYPE_INCREMENTAL"
        body["incrementalSnapshotMetadata"] = {"previousSnapshotIdentity": previous}
    t0 = time.monotonic()
    created = time.time()
    r = api.call("POST", "/hotLoads", json=body)
    r.raise_for_status()
    hl_id = r.json()["hotLoad"]["spec"]["id"]
    while True:
        hl = api.call("GET", f"/hotLoads/{hl_id}").json()["hotLoad"]
        if hl["status"]["state"] in TERMINAL_HOT_LOAD_STATES:
            break
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    finished = datetime.fromisoformat(hl["status"]["finishedAt"].replace("Z", "+00:00")).timestamp()
    hl["_shownAfterMs"] = (time.time() - finished) * 1000  # how long after its end the GET showed it
    if hl["status"]["state"] != "HOT_LOAD_STATE_COMPLETED":
        raise SystemExit(f"hot-load {identity} ended {hl['status']['state']}: {hl['status'].get('conditions')}")
    return hl, elapsed, created


async def cold_rolling_restart(settings, identity_prefix: str, replicas: int, model_name: str, work: Path) -> float:
    """Restart `replicas` engines one after another on the new full checkpoint from the bucket."""
    s3 = settings.s3_client()
    t0 = time.monotonic()
    for i in range(replicas):
        model_dir = work / f"cold-{i}"
        shutil.rmtree(model_dir, ignore_errors=True)
        # A restarted replica has nothing local: it downloads the full checkpoint first.
        await asyncio.to_thread(download_prefix, s3, settings.bucket, identity_prefix, model_dir)
        engine = EngineProcess(
            model_dir,
            work_dir=Path(tempfile.mkdtemp(prefix="cold-", dir="/tmp")),
            served_model_name=model_name,
            port=free_port(),
        )
        await engine.start()
        await engine.stop()
    return time.monotonic() - t0


def _step_seconds(replica: dict) -> float:
    def at(key: str) -> float:
        return datetime.fromisoformat(replica[key].replace("Z", "+00:00")).timestamp()

    return at("finishedAt") - at("startedAt")


def print_timeline(settings, workflow_id: str, created: float) -> None:
    """Each activity of a hot-load's workflow history: when it was scheduled, started and
    closed, in ms since the hot-load's create call (`created`, wall clock)."""

    out = subprocess.run(
        [
            str(TEMPORAL_BIN),
            "workflow",
            "show",
            "-w",
            workflow_id,
            "-o",
            "json",
            "--address",
            settings.temporal_address,
            "--namespace",
            settings.temporal_namespace,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout

    def ms(event: dict) -> float:
        return (datetime.fromisoformat(event["eventTime"].replace("Z", "+00:00")).timestamp() - created) * 1000

    rows: dict[str, list] = {}
    for event in json.loads(out)["events"]:
        attrs = event.get("activityTaskScheduledEventAttributes")
        if attrs:
            queue = attrs["taskQueue"]["name"].rsplit("/", 1)[-1]
            rows[str(event["eventId"])] = [attrs["activityType"]["name"], queue, ms(event), None, None]
            continue
        for kind, col in (
            ("activityTaskStartedEventAttributes", 3),
            ("activityTaskCompletedEventAttributes", 4),
            ("activityTaskFailedEventAttributes", 4),
            ("activityTaskCanceledEventAttributes", 4),
        ):
            if kind in event:
                rows[str(event[kind]["scheduledEventId"])][col] = ms(event)
        if "workflowExecutionStartedEventAttributes" in event:
            print(f"    {ms(event):7.0f} ms  workflow started")
        if "workflowExecutionCompletedEventAttributes" in event:
            print(f"    {ms(event):7.0f} ms  workflow completed")
    for name, queue, scheduled, started, closed in rows.values():
        print(
            f"    {scheduled:7.0f} ms  {name:18s} {queue:18s} started +{(started or scheduled) - scheduled:4.0f}, "
            f"closed at {closed or float('nan'):7.0f} ms"
        )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=256)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold-runs", type=int, default=1)
    ap.add_argument("--max-concurrent-swaps", type=int, default=1, help="hotLoad.maxConcurrentSwaps")
    ap.add_argument("--keep", action="store_true", help="keep the stack's home (logs) afterwards")
    ap.add_argument("--timeline", action="store_true", help="print the last hot-load's activities in time")
    return ap.parse_args()


def publish(settings: Settings, work: Path, info: dict) -> None:
    """The pair given the base model's tokenizer, its delta written, the base and the new full uploaded."""
    base, new = work / "base", work / "new"
    give_base_tokenizer(settings, base, new)
    stats = write_delta(base, new, work / "delta", version="1", base_version="0")
    print(
        f"model {info['tensor_bytes'] / 2**20:.0f} MiB BF16, {info['changed_element_fraction'] * 100:.2f}% of "
        f"elements changed; delta {stats.wire_bytes / 2**20:.1f} MiB "
        f"({stats.wire_bytes / info['tensor_bytes'] * 100:.2f}% of full)",
        flush=True,
    )
    s3 = settings.s3_client()
    upload_dir(s3, base, settings.bucket, "bench/model")
    upload_dir(s3, new, settings.bucket, "bench/new-full")


def create_ready_deployment(settings: Settings, api: Api, args: argparse.Namespace) -> str:
    body = {
        "name": "bench",
        "gatewayIds": [settings.gateway_id],
        "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
        "model": {"name": "bench-model", "bucket": settings.bucket, "path": "bench/model"},
        "autoscaling": {"min": args.replicas, "max": args.replicas},
        "hotLoad": {
            "bucket": settings.bucket,
            "pathPrefix": "bench/ckpt",
            "maxConcurrentSwaps": args.max_concurrent_swaps,
        },
    }
    dep_id = api.call("POST", "/deployments", json=body).json()["deployment"]["spec"]["id"]
    dep = api.wait_deployment(dep_id, timeout=1800)
    assert dep["status"]["status"] == "STATUS_READY", dep["status"]
    return dep_id


@dataclass
class HotRuns:
    seconds: list[float] = field(default_factory=list)
    pauses: list[float] = field(default_factory=list)  # every replica's, every run
    bytes_per_replica: list[list[int]] = field(default_factory=list)  # per run
    last: dict | None = None  # the last delta hot-load
    last_created: float = 0.0


def measure_hot_loads(settings: Settings, api: Api, dep_id: str, work: Path, runs: int) -> HotRuns:
    """Per run: a FULL base, then the delta on it (timed)."""
    s3 = settings.s3_client()
    out = HotRuns()
    for run in range(runs):
        upload_dir(s3, work / "base", settings.bucket, f"bench/ckpt/base-{run}")
        upload_dir(s3, work / "delta", settings.bucket, f"bench/ckpt/step-{run}")
        hot_load(api, dep_id, f"base-{run}", None)
        hl, seconds, out.last_created = hot_load(api, dep_id, f"step-{run}", f"base-{run}")
        out.last = hl
        reps = api.call("GET", f"/hotLoads/{hl['spec']['id']}/replicas").json()["replicas"]
        out.seconds.append(seconds)
        out.pauses += [r["pauseMs"] for r in reps]
        out.bytes_per_replica.append([r["bytesReadFromBucket"] for r in reps])
        print(
            f"  hot-load run {run}: {seconds:.2f} s; step s {[round(_step_seconds(r), 2) for r in reps]}; "
            f"pause ms {[round(r['pauseMs'], 1) for r in reps]}; sources {[r['source'] for r in reps]}; "
            f"end shown by GET {hl['_shownAfterMs']:.0f} ms after finishedAt",
            flush=True,
        )
    return out


def measure_cold(settings: Settings, args: argparse.Namespace, work: Path) -> list[float]:
    cold: list[float] = []
    for run in range(args.cold_runs):
        seconds = asyncio.run(cold_rolling_restart(settings, "bench/new-full", args.replicas, "bench-model", work))
        cold.append(seconds)
        print(f"  cold rolling restart run {run}: {seconds:.1f} s", flush=True)
    return cold


def print_summary(args: argparse.Namespace, hot: HotRuns, cold: list[float], tensor_bytes: int) -> None:
    a = statistics.median(hot.seconds)
    b = statistics.median(cold) if cold else float("nan")
    print()
    print(f"replicas                         {args.replicas} (maxConcurrentSwaps {args.max_concurrent_swaps})")
    print(f"(a) delta hot-load, median       {a:.2f} s  ({args.runs} runs)")
    print(f"(b) cold rolling restart, median {b:.1f} s  ({args.cold_runs} runs)")
    print(f"(b)/(a)                          {b / a:.1f}x")
    print(
        f"pause window per replica         median {statistics.median(hot.pauses):.1f} ms, max {max(hot.pauses):.1f} ms"
    )
    print(f"bytes from the bucket per replica {hot.bytes_per_replica[-1]}  (full checkpoint: {tensor_bytes})")


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-hotload-"))
    info = make_checkpoint_pair(work / "base", work / "new", size_mb=args.size_mb, seed=0)
    with stack_in(work, keep=args.keep, kept_note=" (replica logs under home/replicas/)") as (_, settings):
        publish(settings, work, info)
        api = Api(settings)
        dep_id = create_ready_deployment(settings, api, args)
        hot = measure_hot_loads(settings, api, dep_id, work, args.runs)
        if args.timeline and hot.last is not None:
            print_timeline(
                settings, hot_load_workflow_id(settings.organization_id, hot.last["spec"]["id"]), hot.last_created
            )
        cold = measure_cold(settings, args, work)
        print_summary(args, hot, cold, info["tensor_bytes"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
