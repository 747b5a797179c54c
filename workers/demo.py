"""`make demo`: the main job end to end on the embedded stack, then a short table.

Starts the stack (unless it already runs), creates a 2-replica deployment of the embedded model,
publishes a FULL checkpoint (the "counting" model: after token i it greedily says i+1, so the
change is visible), hot-loads it through the REST API, and prints the identity, the seconds from
create to COMPLETED, the replicas READY, and a sample completion before and after. Then it
deletes the deployment and stops what it started.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from workers.settings import Settings
from workers.stack import Stack, StackError, load_or_create_settings, upload_dir

PROMPT_IDS = [5, 100, 200, 300]


class Client:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.api = f"{settings.api_url}/v1alpha1/inference"
        self.h = {"Authorization": f"Bearer {settings.admin_token}"}

    def call(self, method: str, path: str, **kw: Any) -> dict:
        r = httpx.request(method, f"{self.api}{path}", headers=self.h, timeout=60, **kw)
        if r.status_code >= 400:
            raise StackError(f"{method} {path}: HTTP {r.status_code} {r.text}")
        return r.json()

    def sample(self, model: str) -> tuple[list[int], str]:
        r = httpx.post(
            f"{self.s.gateway_url}/v1/completions",
            headers=self.h,
            json={"model": model, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0,
                  "return_token_ids": True, "ignore_eos": True},
            timeout=120,
        )
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return list(choice["token_ids"]), choice["text"]


def run_demo(home: Path, *, port_base: int | None = None, keep_running: bool = False) -> int:
    from workers.base_model import write_counting_model

    settings = load_or_create_settings(home, port_base)
    stack = Stack(settings)
    was_running = all(stack.status().get(n) for n in ("temporal", "s3", "api", "worker", "gateway"))
    t_up = time.monotonic()
    stack.up(say=lambda line: print(line, flush=True))
    up_s = time.monotonic() - t_up
    c = Client(settings)
    dep_id = None
    try:
        name = f"demo-{int(time.time())}"
        body = {
            "name": name, "gatewayIds": [settings.gateway_id],
            "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
            "resources": {"instanceType": "cpu-local", "gpuCount": 0},
            "model": {"name": settings.model_name, "bucket": settings.bucket, "path": settings.base_model_path},
            "autoscaling": {"min": 2, "max": 2}, "traffic": {"weight": 100},
            "hotLoad": {"bucket": settings.bucket, "pathPrefix": f"checkpoints/{name}",
                        "transitionMode": "TRANSITION_MODE_ASYNC"},
        }
        t0 = time.monotonic()
        dep_id = c.call("POST", "/deployments", json=body)["deployment"]["spec"]["id"]
        print(f"deployment {dep_id}: starting 2 vLLM CPU replicas (about a minute each on 2 cores)...", flush=True)
        while True:
            dep = c.call("GET", f"/deployments/{dep_id}")["deployment"]
            if dep["status"]["status"] == "STATUS_READY":
                break
            if dep["status"]["status"] == "STATUS_FAILED":
                raise StackError(f"deployment failed: {dep['status']['conditions']}")
            time.sleep(2)
        ready_s = time.monotonic() - t0
        print(f"deployment READY in {ready_s:.1f}s", flush=True)
        before = c.sample(settings.model_name)

        identity = "step-000001"
        ckpt = write_counting_model(settings.home_path / "models" / "base", settings.home_path / "demo" / "counting")
        upload_dir(settings.s3_client(), ckpt, settings.bucket, f"checkpoints/{name}/{identity}")
        t1 = time.monotonic()
        hl = c.call("POST", "/hotLoads", json={"deploymentId": dep_id, "identity": identity, "type": "SNAPSHOT_TYPE_FULL"})
        hl_id = hl["hotLoad"]["spec"]["id"]
        last = None
        while True:
            hl = c.call("GET", f"/hotLoads/{hl_id}")["hotLoad"]
            reps = c.call("GET", f"/hotLoads/{hl_id}/replicas")["replicas"]
            view = (hl["status"]["state"], tuple((r["name"], r["state"]) for r in reps))
            if view != last:
                print(f"  {time.monotonic() - t1:5.1f}s {hl['status']['state']}: "
                      + ", ".join(f"{r['name']}={r['state']}" for r in reps), flush=True)
                last = view
            if hl["status"]["state"] in ("HOT_LOAD_STATE_COMPLETED", "HOT_LOAD_STATE_FAILED", "HOT_LOAD_STATE_CANCELED"):
                break
            time.sleep(0.25)
        hot_load_s = time.monotonic() - t1
        after = c.sample(settings.model_name)
        ready = sum(1 for r in reps if r["state"] == "READY" and r["currentSnapshotIdentity"] == identity)
        rows = [
            ("identity", identity),
            ("state", hl["status"]["state"]),
            ("create → COMPLETED", f"{hot_load_s:.2f} s"),
            ("replicas READY", f"{ready}/{len(reps)}"),
            ("before", f"{before[0]} {before[1]!r}"),
            ("after", f"{after[0]} {after[1]!r}"),
            ("stack up", f"{up_s:.1f} s"),
            ("deployment ready", f"{ready_s:.1f} s"),
            ("Temporal UI", hl["status"].get("workflowUrl", "")),
        ]
        width = max(len(k) for k, _ in rows)
        print()
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
        print()
        ok = hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED" and ready == len(reps) and before[0] != after[0]
        return 0 if ok else 1
    finally:
        if dep_id:
            try:
                c.call("DELETE", f"/deployments/{dep_id}")
                time.sleep(3)  # let the worker stop the replicas before the stack goes down
            except StackError as exc:
                print(f"warning: {exc}")
        if not was_running and not keep_running:
            stack.down(say=lambda line: print(line, flush=True))
