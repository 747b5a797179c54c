"""Check and measure: once the API answers READY, does the gateway serve the new deployment at
once, while another deployment runs beside it?

The real embedded stack (Temporal dev server, SeaweedFS, API, gateway, control worker, its own
node agent) with real Dynamo vLLM workers on CPU. One deployment runs beside throughout (1
replica). Then `--repeats` times: a new 1-replica deployment is created through the REST API and
polled until READY (as `cwtrain deployment create --wait` does), and at that moment 16
completions are sent at once to it (by its id) and 16 to the deployment beside (the side-by-side
baseline, same moment, same gateway); then it is deleted.

It prints, per repeat: seconds to READY, answers 200 of 16 on each, and the median latency of
the new deployment's first 16 against the baseline's (ratio); at the end the totals. Any non-200
on the new deployment is the READY-then-503 defect; the exit status is 1 then.

    .venv/bin/python bench/ready_then_serve.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.settings import Settings  # noqa: E402
from tests.helpers.deployments import delete_deployment  # noqa: E402
from tests.helpers.stack_fixtures import Api, deployment_body, free_port_base  # noqa: E402
from workers.stack import Stack  # noqa: E402

REQUESTS = 16


def call(api: Api, method: str, path: str, **kw: Any) -> Any:
    r = api.call(method, path, **kw)
    if r.status_code != 200:
        raise SystemExit(f"{method} {path}: {r.status_code} {r.text[:500]}")
    return r.json()


def create_ready(api: Api, body: dict[str, Any], poll_s: float) -> tuple[str, float]:
    t0 = time.monotonic()
    dep_id = call(api, "POST", "/deployments", json=body)["deployment"]["spec"]["id"]
    while (status := call(api, "GET", f"/deployments/{dep_id}")["deployment"]["status"]["status"]) != "STATUS_READY":
        if status == "STATUS_FAILED":
            raise SystemExit(f"deployment {dep_id} FAILED")
        time.sleep(poll_s)
    return dep_id, time.monotonic() - t0


def burst(settings: Settings, targets: list[str]) -> dict[str, list[tuple[int, float]]]:
    """REQUESTS completions to each target deployment, all at once: target -> [(status, seconds)]."""
    headers = {"Authorization": f"Bearer {settings.admin_token}"}

    def one(target: str) -> tuple[int, float]:
        t0 = time.monotonic()
        r = httpx.post(
            f"{settings.gateway_url}/v1/completions",
            headers=headers,
            timeout=300,
            json={"model": target, "prompt": [1, 2, 3], "max_tokens": 2},
        )
        return r.status_code, time.monotonic() - t0

    jobs = [t for t in targets for _ in range(REQUESTS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    return {t: [r for j, r in zip(jobs, results, strict=True) if j == t] for t in targets}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--poll-s", type=float, default=0.5, help="the client's GET cadence while it waits for READY")
    ap.add_argument("--keep", action="store_true", help="keep the stack's home (logs) afterwards")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ready-"))
    settings = Settings.create(work / "home", free_port_base())
    stack = Stack(settings, node_slots=2)
    stack.up(say=lambda line: print(line, flush=True))
    refused = 0
    try:
        api = Api(settings)
        beside, seconds = create_ready(api, deployment_body(settings, "beside", 1, "ready/beside"), args.poll_s)
        print(f"beside: {beside} READY in {seconds:.1f} s", flush=True)
        ratios = []
        for k in range(1, args.repeats + 1):
            dep_id, seconds = create_ready(api, deployment_body(settings, f"new{k}", 1, f"ready/new{k}"), args.poll_s)
            got = burst(settings, [dep_id, beside])
            new_ok = sum(1 for s, _ in got[dep_id] if s == 200)
            base_ok = sum(1 for s, _ in got[beside] if s == 200)
            refused += REQUESTS - new_ok
            new_med = statistics.median(t for _, t in got[dep_id])
            base_med = statistics.median(t for _, t in got[beside])
            ratios.append(new_med / base_med)
            print(
                f"repeat {k}: READY in {seconds:.1f} s; new {new_ok}/{REQUESTS} answered 200 "
                f"(statuses {sorted({s for s, _ in got[dep_id]})}), beside {base_ok}/{REQUESTS}; median latency "
                f"new {new_med * 1000:.0f} ms vs beside {base_med * 1000:.0f} ms: ratio {new_med / base_med:.2f}",
                flush=True,
            )
            delete_deployment(api, dep_id)
        print(
            f"\n{args.repeats} deployments created beside a running one: {refused} of "
            f"{args.repeats * REQUESTS} first requests refused; first-burst median latency vs the "
            f"deployment beside: ratio median {statistics.median(ratios):.2f}"
        )
        return 1 if refused else 0
    finally:
        stack.down(say=lambda line: None)
        if args.keep:
            print(f"home kept: {settings.home_path}")


if __name__ == "__main__":
    sys.exit(main())
