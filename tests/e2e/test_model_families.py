"""Hot-loads of the model families beyond Llama, through the whole service: real Temporal, S3, API,
control worker, gateway and one Dynamo vLLM CPU replica per family; the deltas written by the
real cwtrain.

Families: Qwen3-MoE (per-expert tensors land in the fused experts that vLLM's CPU kernel prepacks
after loading) and Phi-3 (q/k/v and gate/up shipped already fused), small random checkpoints
written by ``transformers`` (tests/helpers/family_models.py). For each: a deployment on one
checkpoint of the family, a FULL hot-load of another, then three cwtrain deltas, each COMPLETED
with exactly the changed tensors proven inside a pause; after each, the engine serves the
trainer's checkpoint, every tensor read back; after the last, greedy completions through the
gateway (token ids and logprobs) equal those of a fresh vLLM engine started on that checkpoint
(started by this test: the reference the update is held to); a corrupted delta FAILS naming its tensor and the replica still
serves the last checkpoint. The other families and TP 2 are checked on vLLM's model classes
without an engine: tests/replica/test_landings.py.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from replica.agent.engine_process import EngineProcess
from snapshots.inspect import read_delta_plan
from tests.helpers.chains import changed_tensors, cwtrain_write_delta
from tests.helpers.deployments import delete_deployment
from tests.helpers.replicas import assert_every_replica_serves, engines, hot_load, hot_load_replicas
from tests.helpers.stack_fixtures import Api, deployment_body
from tests.helpers.trainer import train_step
from workers.families import write_family
from workers.stack import upload_dir

pytestmark = pytest.mark.stack

FAMILIES = ("qwen3_moe", "phi3")
PROMPT_IDS = [5, 100, 200, 300, 17, 42]
GREEDY = {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "logprobs": 1, "ignore_eos": True}


def through_gateway(settings, model: str) -> tuple[list[int], list[float]]:
    """A greedy completion as a trainer asks for it: token ids and their logprobs."""
    r = httpx.post(f"{settings.gateway_url}/v1/completions", headers={"Authorization": f"Bearer {settings.admin_token}"},
                   json={"model": model, **GREEDY, "nvext": {"extra_fields": ["completion_token_ids"]}}, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    return list(answer["nvext"]["completion_token_ids"]), as_float32(answer["choices"][0]["logprobs"]["token_logprobs"])


def as_float32(values: list) -> list[float]:
    """vLLM's logprobs are float32: Dynamo prints each in its shortest float32 form, vLLM's own
    server as the float64 of the same value; compared as the float32 both stand for."""
    return [float(np.float32(x)) for x in values]


def from_engine(engine: EngineProcess) -> tuple[list[int], list[float]]:
    async def ask() -> dict:
        body = {"model": engine.served_model_name, **GREEDY, "return_tokens_as_token_ids": True}
        return (await engine.request("POST", "/v1/completions", json=body)).json()

    logprobs = asyncio.run(ask())["choices"][0]["logprobs"]
    return ([int(t.removeprefix("token_id:")) for t in logprobs["tokens"]],
            as_float32(logprobs["token_logprobs"]))


def corrupt_one_frame(delta: Path) -> str:
    """Flip one bit inside a tensor's frame of ``delta``; returns that tensor's name."""
    plan = read_delta_plan(delta)
    victim = sorted(plan.tensors.values(), key=lambda t: t.name)[0]
    shard = delta / victim.file
    data = bytearray(shard.read_bytes())
    data[(victim.begin + victim.end) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return victim.name


@pytest.mark.parametrize("family", FAMILIES)
def test_a_full_then_cwtrain_deltas_on_a_family_serve_what_a_fresh_engine_serves(stack, family, tmp_path):
    api, s3 = Api(stack), stack.s3_client()
    tokenizer_from = stack.home_path / "models" / "base"
    first = write_family(tmp_path, tokenizer_from, family)
    checkpoints = [write_family(tmp_path, tokenizer_from, family, seed=1)]
    for step in range(1, 4):
        checkpoints.append(train_step(checkpoints[-1], tmp_path / f"step-{step}", seed=step, tensors=6))
    model_path = f"models/families/{family}"
    prefix = f"families/{family}"
    upload_dir(s3, first, stack.bucket, model_path)
    body = deployment_body(stack, f"fam-{family.replace('_', '-')}", replicas=1, path_prefix=prefix)
    body["model"]["path"] = model_path
    r = api.call("POST", "/deployments", json=body)
    assert r.status_code == 200, r.text
    dep_id = r.json()["deployment"]["spec"]["id"]
    # The reference, on the last checkpoint, starts while the deployment's replica does.
    # (A short work dir: vLLM's IPC socket paths under it must stay under 108 bytes.)
    work_dir = Path(tempfile.mkdtemp(prefix="rollouts-fresh-"))
    fresh = EngineProcess(checkpoints[-1], work_dir=work_dir, served_model_name="fresh")
    try:
        asyncio.run(fresh.start(timeout=600))
        dep = api.wait_deployment(dep_id)
        assert dep["status"]["status"] == "STATUS_READY", dep["status"]
        pid = engines(stack, dep_id)[0]["enginePid"]

        full_id = f"{family}-000000"
        upload_dir(s3, checkpoints[0], stack.bucket, f"{prefix}/{full_id}")
        t0 = time.monotonic()
        hl = hot_load(api, dep_id, full_id, None)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
        print(f"{family}: FULL in {time.monotonic() - t0:.1f} s, {hot_load_replicas(api, hl['spec']['id'])}")
        assert_every_replica_serves(stack, dep_id, checkpoints[0])
        prev_id, experts_changed = full_id, 0
        for step in range(1, 4):
            identity = f"{family}-{step:06d}"
            cwtrain_write_delta(checkpoints[step - 1], checkpoints[step], tmp_path / identity, identity, prev_id)
            upload_dir(s3, tmp_path / identity, stack.bucket, f"{prefix}/{identity}")
            t0 = time.monotonic()
            hl = hot_load(api, dep_id, identity, prev_id)
            assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
            [rep] = hot_load_replicas(api, hl["spec"]["id"])
            print(f"{family}: delta {step} in {time.monotonic() - t0:.1f} s, pause {rep['pauseMs']} ms, "
                  f"{rep['verifiedTensors']} proven")
            assert rep["verifiedTensors"] == changed_tensors(checkpoints[step - 1], checkpoints[step])
            assert rep["pauseMs"] > 0
            assert_every_replica_serves(stack, dep_id, checkpoints[step])
            experts_changed += sum(".experts." in n for n in read_delta_plan(tmp_path / identity).tensors)
            prev_id = identity
        if family.endswith("moe"):
            assert experts_changed, "no delta changed an expert tensor: the premise of the MoE test"

        served = through_gateway(stack, body["model"]["name"])
        assert served == from_engine(fresh), "the updated replica answers other than a fresh engine on the checkpoint"

        bad = tmp_path / f"{family}-000004"
        cwtrain_write_delta(checkpoints[3], checkpoints[2], bad, bad.name, prev_id)  # back one step
        victim = corrupt_one_frame(bad)
        upload_dir(s3, bad, stack.bucket, f"{prefix}/{bad.name}")
        hl = hot_load(api, dep_id, bad.name, prev_id)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED", hl["status"]
        [rep] = hot_load_replicas(api, hl["spec"]["id"])
        assert rep["state"] == "ERROR" and victim in rep["errorReason"], rep
        assert_every_replica_serves(stack, dep_id, checkpoints[3])
        assert engines(stack, dep_id)[0]["enginePid"] == pid
    finally:
        asyncio.run(fresh.stop())
        shutil.rmtree(work_dir, ignore_errors=True)
        delete_deployment(api, dep_id)
