"""Delta hot-load across hosts vs on one host, side by side in one run, on network-namespace hosts.

    sudo .venv/bin/python bench/multihost_hot_load.py [--size-mb 128] [--runs 3]

Needs root (it makes three hosts with tests/multihost/hosts.py: network namespaces on a bridge,
each with its own /dev/shm, removed afterwards). The control plane and a node agent with three
slots run in host1. Builds a Llama-shaped BF16 model of about `--size-mb` MiB and one RL step of
it (`snapshots.synthetic`), the deployment's model and the delta in the stack's bucket.

(a) one host: a 3-replica deployment while host1 is the only node: all three replicas there.
(b) across hosts: node agents join in host2 and host3; the same deployment again: one replica per
    host (placement spreads), so the first replica's broadcast crosses the bridge.

Per run and setting: a FULL hot-load of the base (setup, not timed), then the delta, timed from
create to COMPLETED through the REST API. Prints each run, the medians and (b)/(a). Same model,
same machine, same run; the hosts share its cores, so the figure is the ratio.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_kit import give_base_tokenizer  # noqa: E402  (bench/, beside this file)

from contracts.records import TERMINAL_HOT_LOAD_STATES as TERMINAL  # noqa: E402
from snapshots.synthetic import make_checkpoint_pair  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402
from tests.helpers.stack_fixtures import Api  # noqa: E402
from tests.multihost.hosts import Cluster, unavailable_reason  # noqa: E402
from tests.multihost.plane import (  # noqa: E402
    LOCAL_NODE,
    start_control_plane,
    start_node,
    stop_control_plane,
    wait_nodes,
)
from workers.stack import upload_dir  # noqa: E402


def hot_load(api: Api, dep_id: str, identity: str, previous: str | None) -> tuple[dict, float]:
    body: dict = {"deploymentId": dep_id, "identity": identity, "type": "SNAPSHOT_TYPE_FULL"}
    if previous:
        body["type"] = "SNAPSHOT_TYPE_INCREMENTAL"
        body["incrementalSnapshotMetadata"] = {"previousSnapshotIdentity": previous}
    t0 = time.monotonic()
    r = api.call("POST", "/hotLoads", json=body)
    r.raise_for_status()
    hl_id = r.json()["hotLoad"]["spec"]["id"]
    while (hl := api.call("GET", f"/hotLoads/{hl_id}").json()["hotLoad"])["status"]["state"] not in TERMINAL:
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    if hl["status"]["state"] != "HOT_LOAD_STATE_COMPLETED":
        raise SystemExit(f"hot-load {identity} ended {hl['status']['state']}: {hl['status'].get('errorReason')}")
    return hl, elapsed


def measure(api: Api, settings, name: str, runs: int, work: Path, expect_nodes: int) -> list[float]:
    body = {
        "id": name,
        "name": name,
        "gatewayIds": [settings.gateway_id],
        "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
        "model": {"name": "bench-model", "bucket": settings.bucket, "path": "bench/model"},
        "autoscaling": {"min": 3, "max": 3},
        "hotLoad": {"bucket": settings.bucket, "pathPrefix": f"bench/{name}"},
    }
    r = api.call("POST", "/deployments", json=body)
    r.raise_for_status()
    dep = api.wait_deployment(name, timeout=1800)
    assert dep["status"]["status"] == "STATUS_READY", dep["status"]
    s3 = settings.s3_client()
    out = []
    for run in range(runs):
        upload_dir(s3, work / "base", settings.bucket, f"bench/{name}/base-{run}")
        upload_dir(s3, work / "delta", settings.bucket, f"bench/{name}/step-{run}")
        hot_load(api, name, f"base-{run}", None)
        hl, seconds = hot_load(api, name, f"step-{run}", f"base-{run}")
        reps = api.call("GET", f"/hotLoads/{hl['spec']['id']}/replicas").json()["replicas"]
        nodes = sorted({r["node"] for r in reps})
        assert len(nodes) == expect_nodes, nodes
        out.append(seconds)
        print(
            f"  {name} run {run}: {seconds:.2f} s; nodes {[r['node'] for r in reps]}; sources "
            f"{[r['source'] for r in reps]}; pause ms {[round(r['pauseMs'], 1) for r in reps]}",
            flush=True,
        )
    api.call("DELETE", f"/deployments/{name}").raise_for_status()
    deadline = time.monotonic() + 300
    while api.call("GET", f"/deployments/{name}").status_code != 404:
        assert time.monotonic() < deadline, f"deployment {name} not deleted"
        time.sleep(1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if reason := unavailable_reason():
        raise SystemExit(f"cannot make hosts here: {reason}")
    work = Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    try:
        info = make_checkpoint_pair(work / "base", work / "new", size_mb=args.size_mb, seed=0)
        with Cluster(3, base_dir=work / "hosts") as cluster:
            ctl, *others = list(cluster)
            settings = start_control_plane(ctl, node_slots=3)
            try:
                give_base_tokenizer(settings, work / "base", work / "new")
                stats = write_delta(work / "base", work / "new", work / "delta", version="1", base_version="0")
                print(
                    f"model {info['tensor_bytes'] / 2**20:.0f} MiB BF16; delta {stats.wire_bytes / 2**20:.1f} MiB",
                    flush=True,
                )
                upload_dir(settings.s3_client(), work / "base", settings.bucket, "bench/model")
                api = Api(settings)
                wait_nodes(settings, [LOCAL_NODE])
                one = measure(api, settings, "one-host", args.runs, work, expect_nodes=1)
                for host in others:
                    start_node(host, settings, slots=1)
                wait_nodes(settings, [LOCAL_NODE, *(h.name for h in others)])
                spread = measure(api, settings, "three-hosts", args.runs, work, expect_nodes=3)
            finally:
                stop_control_plane(ctl)
        a, b = statistics.median(one), statistics.median(spread)
        print()
        print(f"(a) 3 replicas on one host, delta hot-load median   {a:.2f} s  ({args.runs} runs)")
        print(f"(b) 3 replicas on three hosts, delta hot-load median {b:.2f} s  ({args.runs} runs)")
        print(f"(b)/(a)                                              {b / a:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
