"""``runtime.engine: dynamo-vllm`` (Dynamo's vLLM workers behind Dynamo's frontend) vs ``vllm``
(vLLM's OpenAI servers behind the gateway alone), side by side in one run.

    .venv/bin/python bench/dynamo_vs_vllm.py [--replicas 2] [--runs 3] [--clients 16] [--window 8] [--only dynamo]

One embedded stack in a temporary home whose API lets both engines hot-load
(``ROLLOUTS_HOT_LOAD_ENGINES=dynamo-vllm,vllm``: the guide lets only dynamo-vllm, which is the
stack's default) and, for each engine in turn (one at a time, so at most ``--replicas`` engines
run), a deployment of the embedded model with ``--replicas`` replicas: a FULL hot-load of the base (setup), then
``--runs`` delta hot-loads (one RL step each), each timed from create to COMPLETED through the
REST API while ``--clients`` rollout clients (16-token prompts, 32 tokens at temperature 1,
through the gateway) keep generating for ``--window`` seconds before and after it. Per engine:
the median hot-load seconds, each replica's pause (``pauseMs``) and the medians of its parts
(``pauseBreakdownMs``: until the engine stopped, label, swap call, swap and proof inside the
engine, resume), output tokens/s through the
gateway outside and during the hot-loads (gateway clock), and per-replica memory (PSS of the
engine's process tree, from /proc, after the runs). Prints both and dynamo/vllm ratios. A shared
2-core machine is noisy: compare the two columns of one run (figures: bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from api.app import HOT_LOAD_ENGINES_ENV  # noqa: E402
from common.settings import Settings  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402
from tests.helpers.deployments import delete_deployment  # noqa: E402
from tests.helpers.replicas import engines, hot_load, hot_load_replicas  # noqa: E402
from tests.helpers.stack_fixtures import Api, deployment_body, free_port_base  # noqa: E402
from tests.helpers.trainer import train_step  # noqa: E402
from workers.stack import Stack, upload_dir  # noqa: E402

PREFIX = "bench-engines"


def tree_pss_mib(pid: int) -> float:
    """PSS of ``pid`` and its descendants, MiB."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


async def clients(
    settings: Settings, model: str, n: int, stop: asyncio.Event, tokens: list[float], failures: list[str]
) -> None:
    headers = {"Authorization": f"Bearer {settings.admin_token}"}

    async def one(client: httpx.AsyncClient) -> None:
        rng = random.Random()
        while not stop.is_set():
            body = {
                "model": model,
                "prompt": [rng.randrange(10, 2000) for _ in range(16)],
                "max_tokens": 32,
                "temperature": 1.0,
                "ignore_eos": True,
            }
            try:
                r = await client.post("/v1/completions", json=body)
                if r.status_code != 200:
                    failures.append(f"HTTP {r.status_code}")
                    continue
                tokens.extend([time.monotonic()] * r.json()["usage"]["completion_tokens"])
            except httpx.HTTPError as exc:
                failures.append(repr(exc))

    async with httpx.AsyncClient(
        base_url=settings.gateway_url, headers=headers, timeout=600, limits=httpx.Limits(max_connections=n + 4)
    ) as client:
        await asyncio.gather(*(one(client) for _ in range(n)))


def timed_hot_load(api: Api, dep_id: str, identity: str, previous: str | None) -> tuple[dict, float]:
    t0 = time.monotonic()
    hl = hot_load(api, dep_id, identity, previous)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    return hl, time.monotonic() - t0


async def measure(settings: Settings, engine: str, args: argparse.Namespace, work: Path) -> dict:
    api = Api(settings)
    prefix = f"{PREFIX}/{engine}"
    body = deployment_body(settings, f"bench-{engine}", replicas=args.replicas, path_prefix=prefix)
    body["runtime"]["engine"] = engine
    dep = api.call("POST", "/deployments", json=body).json()["deployment"]
    try:
        dep_id, model = dep["spec"]["id"], dep["spec"]["model"]["name"]
        assert api.wait_deployment(dep_id)["status"]["status"] == "STATUS_READY"
        s3, base = settings.s3_client(), settings.home_path / "models" / "base"
        upload_dir(s3, base, settings.bucket, f"{prefix}/full")
        timed_hot_load(api, dep_id, "full", None)
        seconds, pauses, outside, during, parts = [], [], [], [], []
        prev_dir, prev_id = base, "full"
        for run in range(1, args.runs + 1):
            new_dir = train_step(prev_dir, work / f"{engine}-{run}", seed=run)
            identity = f"step-{run}"
            write_delta(prev_dir, new_dir, work / f"delta-{engine}-{run}", version=identity, base_version=prev_id)
            upload_dir(s3, work / f"delta-{engine}-{run}", settings.bucket, f"{prefix}/{identity}")
            stop, tokens, failures = asyncio.Event(), [], []
            load = asyncio.create_task(clients(settings, model, args.clients, stop, tokens, failures))
            await asyncio.sleep(args.window)
            t0 = time.monotonic()
            hl, dt = await asyncio.to_thread(timed_hot_load, api, dep_id, identity, prev_id)
            t1 = time.monotonic()
            await asyncio.sleep(args.window)
            stop.set()
            await load
            assert not failures, failures[:5]
            seconds.append(dt)
            replicas = hot_load_replicas(api, hl["spec"]["id"])
            pauses += [r["pauseMs"] for r in replicas]
            parts += [r.get("pauseBreakdownMs") or {} for r in replicas]
            outside.append(sum(1 for t in tokens if t < t0 or t > t1) / (2 * args.window))
            during.append(sum(1 for t in tokens if t0 <= t <= t1) / (t1 - t0))
            prev_dir, prev_id = new_dir, identity
        memory = [tree_pss_mib(r["enginePid"]) for r in await asyncio.to_thread(engines, settings, dep_id)]
        breakdown = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in sorted({k for p in parts for k in p})}
        return {
            "hot_load_s": statistics.median(seconds),
            "pause_ms": sorted(pauses),
            "pause_breakdown_ms": breakdown,
            "tokens_s_outside": statistics.median(outside),
            "tokens_s_during": statistics.median(during),
            "memory_mib": memory,
        }
    finally:
        delete_deployment(api, dep["spec"]["id"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--window", type=float, default=8.0)
    p.add_argument("--only", choices=("vllm", "dynamo"), help="measure one engine (no ratios)")
    args = p.parse_args()
    os.environ[HOT_LOAD_ENGINES_ENV] = "dynamo-vllm,vllm"  # the stack's API inherits it
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        settings = Settings.create(Path(tmp) / "home", free_port_base())
        stack = Stack(settings)
        stack.up(say=lambda line: None)
        results = {}
        try:
            for name, engine in (("vllm", "vllm"), ("dynamo", "dynamo-vllm")):
                if args.only and name != args.only:
                    continue
                print(f"[{name}] measuring ...", flush=True)
                results[name] = asyncio.run(measure(settings, engine, args, Path(tmp)))
                print(f"[{name}] {results[name]}", flush=True)
        finally:
            stack.down(say=lambda line: None)
    for name, r in results.items():
        print(
            f"{name}: pause median {statistics.median(r['pause_ms']):.1f} ms; its parts (medians, ms): "
            + ", ".join(f"{k} {v:.1f}" for k, v in r["pause_breakdown_ms"].items())
        )
    if args.only:
        return 0
    v, d = results["vllm"], results["dynamo"]
    rows = [
        ("delta hot-load, median s", v["hot_load_s"], d["hot_load_s"]),
        ("pause per replica, median ms", statistics.median(v["pause_ms"]), statistics.median(d["pause_ms"])),
        ("tokens/s outside hot-loads", v["tokens_s_outside"], d["tokens_s_outside"]),
        ("tokens/s during hot-loads", v["tokens_s_during"], d["tokens_s_during"]),
        ("memory per replica, MiB (PSS)", statistics.mean(v["memory_mib"]), statistics.mean(d["memory_mib"])),
    ]
    print(f"\n{args.replicas} replicas, {args.runs} delta hot-loads each, {args.clients} clients")
    print(f"{'':34}{'vllm':>10}{'dynamo':>10}{'dynamo/vllm':>13}")
    for label, a, b in rows:
        print(f"{label:34}{a:10.2f}{b:10.2f}{b / a:13.2f}")
    print(f"pauses ms: vllm {v['pause_ms']}, dynamo {d['pause_ms']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
