"""Fail closed on the real stack: a FULL snapshot that the engines cannot serve byte for byte
(one BF16 tensor's header dtype edited to F16, its bytes and checksums untouched) ends FAILED
and every replica keeps serving exactly what it served before: the same bytes (read back from
each engine), the same weight-version label, the same logprobs. Then a good snapshot completes.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from snapshots.host import checkpoint_checksums
from tests.helpers.engine_weights import fixed_answer
from tests.helpers.replicas import ROLLING_PREFIX, attach, engines, hot_load, served_checksums
from workers.base_model import INDEX_NAME
from workers.stack import upload_dir

pytestmark = pytest.mark.stack

EDITED = "lm_head.weight"


def with_dtype_edited(base: Path, out: Path, name: str) -> Path:
    """A copy of checkpoint `base` whose tensor `name` says F16 in its header instead of BF16
    (the same bytes, so its recorded Adler-32 still matches the file)."""
    shutil.copytree(base, out)
    shard = out / json.loads((base / INDEX_NAME).read_text())["weight_map"][name]
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert tensors[name].dtype == torch.bfloat16
    tensors[name] = tensors[name].view(torch.float16)
    save_file(tensors, str(shard), metadata=metadata)
    return out


def observe(replica: dict) -> dict:
    """What one engine serves: its weight-version label and the logprobs of a fixed greedy
    completion (top 5 per token; a fresh cache salt, so nothing comes from the prefix cache)."""

    async def read() -> dict:
        engine = attach(replica)
        try:
            answer = await fixed_answer(engine, (await engine.models())[0])
            return {"label": await engine.weight_version(), **answer}
        finally:
            await engine.aclose()

    return asyncio.run(read())


def test_a_dtype_edited_full_snapshot_fails_and_every_replica_serves_its_previous_weights(stack, rolling, tmp_path):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    good_id = "closed-000000"
    upload_dir(s3, base, stack.bucket, f"{ROLLING_PREFIX}/{good_id}")
    assert hot_load(api, dep_id, good_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    before = {r["name"]: (served_checksums(r), observe(r)) for r in engines(stack, dep_id)}
    assert all(seen["label"] == good_id for _, seen in before.values()), before

    bad_id = "closed-000001"
    edited = with_dtype_edited(base, tmp_path / bad_id, EDITED)
    assert checkpoint_checksums(edited) == checkpoint_checksums(base)  # only the header differs
    upload_dir(s3, edited, stack.bucket, f"{ROLLING_PREFIX}/{bad_id}")
    hl = hot_load(api, dep_id, bad_id, None)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED", hl["status"]
    reps = api.call("GET", f"/hotLoads/{hl['spec']['id']}/replicas").json()["replicas"]
    first = reps[0]
    assert first["state"] == "ERROR", first
    assert EDITED in first["errorReason"] and "float16" in first["errorReason"], first["errorReason"]
    assert all(r["currentSnapshotIdentity"] == good_id for r in reps), reps
    after = {r["name"]: (served_checksums(r), observe(r)) for r in engines(stack, dep_id)}
    assert after == before, "a refused snapshot changed what a replica serves or how it labels it"

    again = "closed-000002"
    upload_dir(s3, base, stack.bucket, f"{ROLLING_PREFIX}/{again}")
    assert hot_load(api, dep_id, again, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    for replica in engines(stack, dep_id):
        assert served_checksums(replica) == checkpoint_checksums(base)
        assert observe(replica)["label"] == again
