"""Dynamo's KV-aware router vs its least-loaded router on GRPO groups: the prefix-cache hit rate.

    .venv/bin/python bench/dynamo_kv_routing.py [--replicas 2] [--groups 16] [--samples 8] [--prompt 400] [--waves 4]

For each router mode in turn, an embedded stack (``rollouts up --dynamo-router-mode MODE``,
in a temporary home; one at a time) with a ``--replicas`` deployment of the embedded model. GRPO
groups: ``--groups`` prompts of ``--prompt`` random tokens, each sampled ``--samples`` times as
separate requests (16 tokens at temperature 1): the first alone, then the others together
(``--together``: all at once), ``--waves`` groups at once, through the gateway. Prints, per mode: the prefix-cache hit
rate (cached prompt tokens / prompt tokens, from each answer's ``usage.prompt_tokens_details.cached_tokens``), the
groups whose samples all ran on one worker, and the wall time; then kv / least-loaded. (One request with ``n`` samples
always runs on one worker: this measures groups sent as separate requests.)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.settings import Settings  # noqa: E402
from tests.helpers.deployments import delete_deployment  # noqa: E402
from tests.helpers.stack_fixtures import Api, deployment_body, free_port_base  # noqa: E402
from workers.stack import Stack  # noqa: E402


async def run_groups(settings: Settings, model: str, args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {settings.admin_token}"}
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 2000) for _ in range(args.prompt)] for _ in range(args.groups)]
    cached = prompt_tokens = one_worker = 0

    async with httpx.AsyncClient(
        base_url=settings.gateway_url,
        headers=headers,
        timeout=600,
        limits=httpx.Limits(max_connections=args.samples * args.waves + 4),
    ) as client:

        async def sample(prompt: list[int]) -> tuple[int, int, str]:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 1.0,
                "nvext": {"extra_fields": ["worker_id"]},
            }
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            data = r.json()
            usage = data["usage"]
            return (
                usage["prompt_tokens"],
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                data["nvext"]["worker_id"]["decode_worker_id"],
            )

        async def group(prompt: list[int]) -> None:
            nonlocal cached, prompt_tokens, one_worker
            # The first sample alone, then the rest together (--together: all at once): once one
            # worker holds the prompt's blocks, a KV-aware router can send the rest there.
            first = [] if args.together else [await sample(prompt)]
            results = first + list(await asyncio.gather(*(sample(prompt) for _ in range(args.samples - len(first)))))
            prompt_tokens += sum(p for p, _, _ in results)
            cached += sum(c for _, c, _ in results)
            one_worker += len({w for _, _, w in results}) == 1

        t0 = time.monotonic()
        for i in range(0, len(prompts), args.waves):
            await asyncio.gather(*(group(p) for p in prompts[i : i + args.waves]))
        wall = time.monotonic() - t0
    return {"hit_rate": cached / prompt_tokens, "one_worker_groups": one_worker, "wall_s": wall}


def measure(mode: str, args: argparse.Namespace, work: Path) -> dict:
    settings = Settings.create(work / mode, free_port_base())
    settings.dynamo_router_mode = mode
    stack = Stack(settings)
    stack.up(say=lambda line: None)
    try:
        api = Api(settings)
        body = deployment_body(settings, "kvbench", replicas=args.replicas, path_prefix="kvbench")
        dep = api.call("POST", "/deployments", json=body).json()["deployment"]
        assert api.wait_deployment(dep["spec"]["id"])["status"]["status"] == "STATUS_READY"
        result = asyncio.run(run_groups(settings, dep["spec"]["model"]["name"], args))
        delete_deployment(api, dep["spec"]["id"])
        return result
    finally:
        stack.down(say=lambda line: None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=400)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--together", action="store_true", help="send a group's samples all at once")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-kv-") as tmp:
        for mode in ("least-loaded", "kv"):
            print(f"[{mode}] measuring ...", flush=True)
            results[mode] = measure(mode, args, Path(tmp))
            print(f"[{mode}] {results[mode]}", flush=True)
    ll, kv = results["least-loaded"], results["kv"]
    print(
        f"\n{args.groups} groups x {args.samples} samples of a {args.prompt}-token prompt "
        f"({'all at once' if args.together else 'the first alone, then the rest'}), {args.waves} groups at once, "
        f"{args.replicas} workers"
    )
    print(f"{'':32}{'least-loaded':>14}{'kv':>10}{'kv/ll':>8}")
    print(
        f"{'prefix-cache hit rate':32}{ll['hit_rate']:14.3f}{kv['hit_rate']:10.3f}"
        f"{kv['hit_rate'] / max(ll['hit_rate'], 1e-9):8.2f}"
    )
    print(f"{'groups on one worker':32}{ll['one_worker_groups']:14d}{kv['one_worker_groups']:10d}")
    print(f"{'wall s':32}{ll['wall_s']:14.1f}{kv['wall_s']:10.1f}{kv['wall_s'] / ll['wall_s']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
