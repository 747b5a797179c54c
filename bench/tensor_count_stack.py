"""`tensor_count.py --stack`: each checkpoint on the real embedded stack, a 2-replica deployment.

For each checkpoint, one after the other on one stack: vLLM's own start of it (`EngineProcess`:
our vLLM server, which builds no weight map until its first RPC) against the deployment's
create -> READY (both engines started and each one's weight map built and proven), then a FULL
hot-load of the same checkpoint and a delta changing 1 % of every tensor's elements (an
optimizer step, written with our delta writer), each create -> COMPLETED through the REST API,
with the replicas' largest pause. The deployment is deleted before the next checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_kit import Api  # noqa: E402  (bench/, beside this file)
from engine_start import start_once  # noqa: E402  (bench/, beside this file)

from common.settings import Settings  # noqa: E402
from rollouts.client import hot_load_body  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402
from tests.helpers.stack_fixtures import free_port_base, wait_registered  # noqa: E402
from workers.stack import LOCAL_NODE, Stack, upload_dir  # noqa: E402

TERMINAL = ("HOT_LOAD_STATE_COMPLETED", "HOT_LOAD_STATE_FAILED", "HOT_LOAD_STATE_CANCELED")
PREFIX = "tensor-count"
REPLICAS = 2
Change = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def write_step(src: Path, out: Path, change: Change) -> Path:
    """``src`` with every tensor changed by ``change`` (1 % of its elements), in the same files."""
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(7)
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            save_file(
                {n: change(t, gen) for n, t in load_file(str(f)).items()}, str(out / f.name), metadata={"format": "pt"}
            )
        else:
            shutil.copy(f, out / f.name)
    return out


def hot_load(api: Api, dep_id: str, identity: str, previous: str | None) -> dict[str, Any]:
    """create -> terminal seconds of one hot-load, its state and the replicas' largest pause."""
    body = hot_load_body(dep_id, identity, previous_identity=previous, hot_load_id=identity)
    t0 = time.perf_counter()
    api.call("POST", "/hotLoads", json=body)
    while (hl := api.call("GET", f"/hotLoads/{identity}")["hotLoad"])["status"]["state"] not in TERMINAL:
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    replicas = api.call("GET", f"/hotLoads/{identity}/replicas", params={"maxPageSize": 100})["replicas"]
    condition = (hl["status"].get("conditions") or [{}])[-1].get("message", "")
    return {
        "s": round(seconds, 2),
        "state": hl["status"]["state"].removeprefix("HOT_LOAD_STATE_"),
        "max_pause_ms": max((r.get("pauseMs") or 0 for r in replicas), default=0),
        **({"condition": condition[:300]} if hl["status"]["state"] != TERMINAL[0] else {}),
    }


def deploy(api: Api, settings: Settings, name: str, path: str) -> tuple[str, float]:
    """A 2-replica deployment of the checkpoint at ``path``: its id and create -> READY seconds."""
    t0 = time.perf_counter()
    dep_id = api.call(
        "POST",
        "/deployments",
        json={
            "name": name,
            "gatewayIds": [settings.gateway_id],
            "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
            "model": {"name": f"tc-{name}", "bucket": settings.bucket, "path": path},
            "resources": {"instanceType": "cpu-local", "gpuCount": 0},
            "autoscaling": {"min": REPLICAS, "max": REPLICAS},
            "hotLoad": {"bucket": settings.bucket, "pathPrefix": PREFIX},
        },
    )["deployment"]["spec"]["id"]
    while (status := api.call("GET", f"/deployments/{dep_id}")["deployment"]["status"]["status"]) != "STATUS_READY":
        if status == "STATUS_FAILED":
            raise SystemExit(f"{name}: the deployment FAILED")
        time.sleep(0.5)
    return dep_id, time.perf_counter() - t0


def delete(api: Api, dep_id: str) -> None:
    api.http.request("DELETE", f"/deployments/{dep_id}")
    while api.http.request("GET", f"/deployments/{dep_id}").status_code != 404:
        time.sleep(0.5)


def run_stack(dirs: dict[str, Path], root: Path, change: Change, keep: bool = False, own_start: bool = True) -> None:
    """The module docstring's run over the checkpoints ``dirs`` (name -> directory); prints a table.
    ``keep``: leave the stack's home (its logs) in place and print where; ``own_start``: False
    skips vLLM's own starts (a run that looks at the hot-loads alone)."""
    work = Path(tempfile.mkdtemp(prefix="bench-tensor-count-"))
    rows: dict[str, dict[str, Any]] = {}
    for name, model in dirs.items():  # vLLM's own starts first, with no stack beside them
        start = asyncio.run(start_once(model, work, None)) if own_start else float("nan")
        rows[name] = {"vllm_start_s": round(start, 1)}
        print(name, rows[name], flush=True)
    settings = Settings.create(work / "home", free_port_base())
    stack = Stack(settings, node_slots=REPLICAS)
    stack.up(say=lambda line: None)
    try:
        s3 = settings.s3_client()
        api = Api(settings, timeout=300, excerpt=800)
        wait_registered(settings, LOCAL_NODE)
        for name, model in dirs.items():
            new = write_step(model, root / f"{name}-step", change)
            delta = work / f"{name}-d1"
            write_delta(model, new, delta, version=f"{name}-d1", base_version=f"{name}-full")
            upload_dir(s3, model, settings.bucket, f"models/{name}")
            upload_dir(s3, model, settings.bucket, f"{PREFIX}/{name}-full")
            upload_dir(s3, delta, settings.bucket, f"{PREFIX}/{name}-d1")
            dep_id, ready = deploy(api, settings, name, f"models/{name}")
            row = rows[name]
            row["ready_s"] = round(ready, 1)
            row["full"] = hot_load(api, dep_id, f"{name}-full", None)
            row["delta"] = hot_load(api, dep_id, f"{name}-d1", f"{name}-full")
            print(name, json.dumps(row), flush=True)
            delete(api, dep_id)
    finally:
        stack.down(say=lambda line: None)
        if keep:
            print(f"the stack's home (logs): {work / 'home'}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n| {REPLICAS} replicas | " + " | ".join(rows) + " |")
    print("|" + "---|" * (len(rows) + 1))
    for label, get in (
        ("vLLM's own start s", lambda r: f"{r['vllm_start_s']:.1f}"),
        ("create -> READY s", lambda r: f"{r.get('ready_s', float('nan')):.1f}"),
        ("READY / vLLM's start", lambda r: f"{r.get('ready_s', float('nan')) / r['vllm_start_s']:.2f}x"),
        ("FULL create -> COMPLETED s", lambda r: _load(r.get("full"))),
        ("FULL largest pause ms", lambda r: f"{(r.get('full') or {}).get('max_pause_ms', float('nan')):.0f}"),
        ("every-tensor delta create -> COMPLETED s", lambda r: _load(r.get("delta"))),
        ("delta largest pause ms", lambda r: f"{(r.get('delta') or {}).get('max_pause_ms', float('nan')):.0f}"),
    ):
        print(f"| {label} | " + " | ".join(get(r) for r in rows.values()) + " |")


def _load(result: dict[str, Any] | None) -> str:
    if not result:
        return "-"
    return f"{result['s']:.2f}" + ("" if result["state"] == "COMPLETED" else f" {result['state']}")
