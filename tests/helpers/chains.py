"""Publishing snapshot chains to a deployment the way a trainer does, and checking what every
replica then serves (the e2e suites of both engines use it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from snapshots.host import checkpoint_checksums
from snapshots.writer import write_delta
from tests.helpers.replicas import assert_every_replica_serves, engines, hot_load, hot_load_replicas
from tests.helpers.stack_fixtures import cwtrain_python
from tests.helpers.trainer import train_step
from workers.stack import upload_dir


def changed_tensors(old: Path, new: Path) -> int:
    """How many tensors differ between two checkpoints (what a delta between them carries)."""
    a, b = checkpoint_checksums(old), checkpoint_checksums(new)
    assert a.keys() == b.keys()
    return sum(a[name] != b[name] for name in a)


def cwtrain_write_delta(base: Path, new: Path, out: Path, version: str, base_version: str) -> None:
    code = (
        "import sys; from cwtrain.hotload.delta import write_delta; "
        "write_delta(sys.argv[1], sys.argv[2], sys.argv[3], version=sys.argv[4], base_version=sys.argv[5])"
    )
    subprocess.run(
        [str(cwtrain_python()), "-c", code, str(base), str(new), str(out), version, base_version], check=True
    )


def publish_chain(
    stack, api, dep_id, tmp: Path, writer: str, tag: str, *, prefix: str, steps: int = 3, relay: bool = False
) -> None:
    """Full base, then `steps` deltas (ours or cwtrain's, by ``writer``) under the deployment's
    hot-load ``prefix``; after each, every replica is READY, proved exactly the changed tensors in
    a pause, the first read the bucket and the others 0 bytes from it (their update came from a
    peer, one fan-out round after their sender's), and every replica serves exactly the trainer's
    weights; no engine restarted. ``relay`` (a deployment with `peerFanOut` 1): the third replica
    staged the delta from the second, which passed its own stage on."""
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    full_id = f"{tag}-000000"
    upload_dir(s3, base, stack.bucket, f"{prefix}/{full_id}")
    pids = {r["name"]: r["enginePid"] for r in engines(stack, dep_id)}
    hl = hot_load(api, dep_id, full_id, None)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    prev_dir, prev_id = base, full_id
    for step in range(1, steps + 1):
        new_dir = train_step(prev_dir, tmp / f"{tag}-full-{step}", seed=step + (100 if writer == "cwtrain" else 0))
        identity = f"{tag}-{step:06d}"
        delta_dir = tmp / identity
        if writer == "cwtrain":
            cwtrain_write_delta(prev_dir, new_dir, delta_dir, identity, prev_id)
        else:
            stats = write_delta(prev_dir, new_dir, delta_dir, version=identity, base_version=prev_id)
            assert stats.changed > 0
        upload_dir(s3, delta_dir, stack.bucket, f"{prefix}/{identity}")
        hl = hot_load(api, dep_id, identity, prev_id)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
        assert [link["identity"] for link in hl["spec"]["snapshotChain"]] == [full_id] + [
            f"{tag}-{i:06d}" for i in range(1, step + 1)
        ]
        reps = hot_load_replicas(api, hl["spec"]["id"])
        assert [r["state"] for r in reps] == ["READY"] * len(pids)
        changed = changed_tensors(prev_dir, new_dir)
        assert changed > 0
        for r in reps:
            assert r["verifiedTensors"] == changed and r["pauseMs"] > 0, (changed, r)
        assert reps[0]["source"] == "bucket" and reps[0]["bytesReadFromBucket"] > 0
        rounds = {r["name"]: r.get("peerRound") or 0 for r in reps}
        for r in reps[1:]:
            assert r["source"].startswith("peer:"), r
            assert r["bytesReadFromBucket"] == 0, r
            assert r["peerRound"] == 1 + rounds[r["source"].removeprefix("peer:")], r
        if relay:
            assert reps[2]["source"] == f"peer:{reps[1]['name']}", reps
        assert_every_replica_serves(stack, dep_id, new_dir)
        prev_dir, prev_id = new_dir, identity
    assert {r["name"]: r["enginePid"] for r in engines(stack, dep_id)} == pids


_SAMPLE_WITH_ROUTES = """
import asyncio, json, sys
from cwtrain.integrations.rollout import CompletionSampler, RolloutConfig
url, token, model, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])

async def main():
    sampler = CompletionSampler(RolloutConfig(base_url=url, model=model, api_key=token, routed_experts=True))
    try:
        [c] = await sampler.sample(prompt, 1, max_tokens=max_tokens, temperature=0.0)
    finally:
        await sampler.aclose()
    print(json.dumps({"token_ids": list(c.token_ids), "routes": c.routed_experts.tolist(),
                      "dtype": str(c.routed_experts.dtype)}))

asyncio.run(main())
"""


def cwtrain_routes(settings, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion with its routed experts, as cwtrain's rollout integration reads them
    (``RolloutConfig(routed_experts=True)``, unmodified): ``token_ids``, ``routes``
    (``[prompt + completion - 1, layers, top_k]`` as lists) and their ``dtype``."""
    out = subprocess.run(
        [
            str(cwtrain_python()),
            "-c",
            _SAMPLE_WITH_ROUTES,
            f"{settings.gateway_url}/v1",
            settings.admin_token,
            model,
            json.dumps(prompt),
            str(max_tokens),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)
