"""One family's hot-load chain through the whole service, as tests/e2e/test_model_families.py runs
it at tensor-parallel size 1 or 2: real Temporal, S3, API, control worker, gateway and one Dynamo
vLLM CPU replica; the deltas written by the real cwtrain.

The deployment starts on the chain's first checkpoint (small random weights of the family,
workers/families.py). Then a FULL hot-load of the next one (the engine answers differently: the
premise) and two cwtrain deltas on from it (each an optimizer-like step that changes every
tensor), each COMPLETED with exactly the changed tensors proven inside a pause and, after each,
every tensor read back equal to the trainer's (each rank's shards against the same regions of the
trainer's tensors), and only the changed elements written inside the pause (``swapBytes``). After
every hot-load, the greedy completion through the gateway (token ids and logprobs) is exactly what
a fresh engine started on that checkpoint answers (``tests.helpers.fresh_answers``: the engine
the deployment's ``engineConfig`` describes, built from the checkpoint by vLLM's own loader), and
none of these checkpoints is the one the engine started on: a tensor vLLM derives at start (a
packed copy, ``A = -exp(A_log)``, an absorbed projection) that a hot-load left stale would answer
otherwise. Where asked, a sparse delta (changed elements as indices and values) one step back,
COMPLETED and compared the same way. A corrupted delta FAILS naming its tensor, the replica still
serves (and answers) what it served, and its engine never restarted. At tensor-parallel size 2,
every socket the ranks listen on is on the stack's host, and no rank compiled code (inductor).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from replica.engine import scatter
from snapshots.inspect import read_delta_plan
from snapshots.sparse_writer import write_sparse_delta
from tests.helpers.chains import changed_tensors, cwtrain_routes, cwtrain_write_delta
from tests.helpers.deployments import delete_deployment
from tests.helpers.fresh_answers import FreshAnswers
from tests.helpers.replicas import assert_every_replica_serves, engines, hot_load, hot_load_replicas
from tests.helpers.stack_fixtures import Api, deployment_body
from tests.helpers.trainer import train_step
from workers.families import MOE, write_family
from workers.stack import upload_dir

# A scattered element crosses as its value at the parameter's width and an int64 offset on the
# host: at most (4 + 8) / 2 times its BF16 bytes (a bias kept in float32). On the host a tensor
# goes whole when count * HOST_SCATTER_ELEMENT_BYTES >= its bytes (faster than its scatter):
# then at most HOST_SCATTER_ELEMENT_BYTES / 2 times its changed BF16 bytes
# (replica/engine/scatter.py).
SCATTER_OVERHEAD = max(6, scatter.HOST_SCATTER_ELEMENT_BYTES // 2)
PROMPT_IDS = [5, 100, 200, 300, 17, 42]
ROUTES_KEY = "enable-return-routed-experts"
EVERY = 10**9  # train_step changes this many tensors: all of them
GREEDY = {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "logprobs": 1, "ignore_eos": True}


def through_gateway(settings, model: str) -> tuple[list[int], list[float]]:
    """A greedy completion as a trainer asks for it: token ids and their logprobs (float32, as the
    engine computes them: Dynamo writes each as the shortest decimal that reads back to it)."""
    r = httpx.post(
        f"{settings.gateway_url}/v1/completions",
        headers={"Authorization": f"Bearer {settings.admin_token}"},
        json={"model": model, **GREEDY, "nvext": {"extra_fields": ["completion_token_ids"]}},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
    return list(answer["nvext"]["completion_token_ids"]), [np.float32(p).item() for p in logprobs]


def routes_of(settings, model: str, config: dict) -> dict:
    """The greedy completion's routed experts as cwtrain reads them, in the guide's shape:
    ``[prompt + completion - 1, layers, top_k]``, every id one of the model's experts."""
    got = cwtrain_routes(settings, model, PROMPT_IDS, GREEDY["max_tokens"])
    rows = len(PROMPT_IDS) + len(got["token_ids"]) - 1
    experts = config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    assert [len(got["routes"]), len(got["routes"][0]), len(got["routes"][0][0])] == [rows, layers, top_k], got
    ids = {e for row in got["routes"] for layer in row for e in layer}
    assert ids <= set(range(experts)) and len(ids) > top_k, ids
    return got


def streamed_routes(settings, model: str) -> list:
    """The greedy completion streamed: its routes, from the chunk that carries ``finish_reason``
    (the guide's place on a stream), as lists."""
    body = {
        "model": model,
        "prompt": PROMPT_IDS,
        "max_tokens": GREEDY["max_tokens"],
        "temperature": 0,
        "stream": True,
        "nvext": {"extra_fields": ["routed_experts"]},
    }
    found = []
    with httpx.stream(
        "POST",
        f"{settings.gateway_url}/v1/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {settings.admin_token}"},
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "routed_experts" in (chunk.get("nvext") or {}):
                assert any(c.get("finish_reason") for c in chunk["choices"]), chunk
                found.append(chunk["nvext"]["routed_experts"])
    [routed] = found
    array = np.frombuffer(base64.b64decode(routed["data"]), dtype=routed["dtype"]).reshape(routed["shape"])
    return array.tolist()


def off_host_sockets(pid: int, host: str) -> list[str]:
    """Listening sockets of ``pid`` and its descendants (an engine's ranks) not on ``host``."""
    root = psutil.Process(pid)
    wrong = []
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            wrong += [
                f"{proc.pid} {' '.join(proc.cmdline())[:80]} {c.laddr.ip}:{c.laddr.port}"
                for c in proc.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.ip != host
            ]
    return wrong


def compiled_code(pid: int) -> list[str]:
    """What inductor compiled in the engine ``pid``'s cache (its ``TORCHINDUCTOR_CACHE_DIR``)."""
    cache = Path(psutil.Process(pid).environ()["TORCHINDUCTOR_CACHE_DIR"])
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.suffix in (".so", ".cpp"))


def corrupt_one_frame(delta: Path) -> str:
    """Flip one bit inside a tensor's frame of ``delta``; returns that tensor's name."""
    plan = read_delta_plan(delta)
    victim = sorted(plan.tensors.values(), key=lambda t: t.name)[0]
    shard = delta / victim.file
    data = bytearray(shard.read_bytes())
    data[(victim.begin + victim.end) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return victim.name


def run_family_chain(
    stack,
    family: str,
    tp: int,
    tmp_path: Path,
    sparse: bool = False,
    routes: bool = False,
    engine_config: dict[str, str] | None = None,
) -> list[dict]:
    """The chain the module docstring describes, on ``family`` at tensor-parallel size ``tp``;
    returns each COMPLETED hot-load's figures (what, seconds from create to COMPLETED as the
    test polls it, the replica's pause in ms, tensors proven). ``sparse``: then one step back
    as a sparse delta (changed elements only, snapshots/sparse.py), before the corrupted one.
    ``routes``: the deployment returns routed experts (``enable-return-routed-experts``), read
    through cwtrain's rollout integration fresh, after the FULL (other than at start) and after the
    last delta (then also from a stream's finishing chunk: the fresh engine's routes).
    ``engine_config``: more of the deployment's ``runtime.engineConfig`` (vLLM flags)."""
    api, s3 = Api(stack), stack.s3_client()
    tokenizer_from = stack.home_path / "models" / "base"
    checkpoints = [write_family(tmp_path, tokenizer_from, family, seed=1)]  # the engine starts on it
    for step in range(1, 4):  # an optimizer's step: every tensor changes (Mamba's A_log and conv1d included)
        checkpoints.append(train_step(checkpoints[-1], tmp_path / f"step-{step}", seed=step, tensors=EVERY, lr=1e-2))
    config_of_engine = dict(engine_config or {})
    if tp > 1:
        config_of_engine["tensor-parallel-size"] = str(tp)
    if routes:
        config_of_engine[ROUTES_KEY] = ""
    # Each compared checkpoint answered by an engine started on it, in the background while the
    # deployment starts: at TP 1 every one (on the first, the deployment's own: the two engines
    # agree); at TP 2, whose reference engines start two ranks each (minutes on 2 cores), only the
    # last one the chain reaches, which no derived tensor left stale since the start can match
    # (test_landings compares each rank's derived tensors with a fresh load at TP 2 too).
    compared = [0, 1, 2, 3] if tp == 1 else [3]
    fresh = FreshAnswers([checkpoints[i] for i in compared], config_of_engine, GREEDY, tmp_path / "fresh")
    model_path = f"models/families/{family}-tp{tp}"
    prefix = f"families/{family}-tp{tp}"
    upload_dir(s3, checkpoints[0], stack.bucket, model_path)
    body = deployment_body(stack, f"fam-{family.replace('_', '-')}-tp{tp}", replicas=1, path_prefix=prefix)
    body["model"]["path"] = model_path
    if config_of_engine:
        body["runtime"]["engineConfig"] = config_of_engine
    r = api.call("POST", "/deployments", json=body)
    assert r.status_code == 200, r.text
    dep_id = r.json()["deployment"]["spec"]["id"]
    model = body["model"]["name"]
    config = json.loads((checkpoints[0] / "config.json").read_text())
    figures: list[dict] = []
    try:
        dep = api.wait_deployment(dep_id)
        assert dep["status"]["status"] == "STATUS_READY", dep["status"]
        pid = engines(stack, dep_id)[0]["enginePid"]
        assert_every_replica_serves(stack, dep_id, checkpoints[0])
        at_start = through_gateway(stack, model)
        assert 0 not in compared or at_start == fresh.answer(checkpoints[0]), (
            f"the deployment's engine answers {at_start} on its first checkpoint, the reference engine "
            f"{fresh.answer(checkpoints[0])}: the reference is not the deployment's engine"
        )
        start_routes = routes_of(stack, model, config) if routes else None

        def publish(identity: str, previous: str | None, what: str, serves: int) -> dict:
            """Hot-load ``identity`` (uploaded already): COMPLETED, every tensor read back equal to
            ``checkpoints[serves]``'s and the answers a fresh engine's on it; the replica's entry."""
            t0 = time.monotonic()
            hl = hot_load(api, dep_id, identity, previous)
            assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
            [rep] = hot_load_replicas(api, hl["spec"]["id"])
            figures.append(
                {
                    "what": what,
                    "seconds": round(time.monotonic() - t0, 1),
                    "pause_ms": rep["pauseMs"],
                    "proven": rep["verifiedTensors"],
                    "swap_bytes": rep.get("swapBytes"),
                }
            )
            assert_every_replica_serves(stack, dep_id, checkpoints[serves])
            if serves not in compared:
                return rep
            got, want = through_gateway(stack, model), fresh.answer(checkpoints[serves])
            assert got == want, f"after the {what}, the replica answers {got}, a fresh engine on its checkpoint {want}"
            return rep

        full_id = f"{family}-000001"
        upload_dir(s3, checkpoints[1], stack.bucket, f"{prefix}/{full_id}")
        publish(full_id, None, "FULL", 1)
        assert fresh.answer(checkpoints[compared[-1]]) != at_start, (
            "another checkpoint answers the same: the premise of the check"
        )
        if routes:
            assert routes_of(stack, model, config)["routes"] != start_routes["routes"], (
                "another checkpoint routes the same: the premise of the routes check"
            )
        prev_id, experts_changed = full_id, 0
        for step in range(2, 4):
            identity = f"{family}-{step:06d}"
            cwtrain_write_delta(checkpoints[step - 1], checkpoints[step], tmp_path / identity, identity, prev_id)
            upload_dir(s3, tmp_path / identity, stack.bucket, f"{prefix}/{identity}")
            rep = publish(identity, prev_id, f"delta {step - 1}", step)
            assert rep["verifiedTensors"] == changed_tensors(checkpoints[step - 1], checkpoints[step])
            assert rep["pauseMs"] > 0
            # Only the changed elements cross into the engine inside the pause (replica/engine/scatter.py).
            moved = rep["swapBytes"]
            assert 0 < moved["pause_bytes"] <= SCATTER_OVERHEAD * moved["changed_bytes"], moved
            experts_changed += sum(".experts." in n for n in read_delta_plan(tmp_path / identity).tensors)
            prev_id = identity
        if family in MOE:
            assert experts_changed, "no delta changed an expert tensor: the premise of the MoE test"
        if routes:  # after a delta hot-load, the routes a fresh engine takes, read by cwtrain
            got = routes_of(stack, model, config)
            assert [got["token_ids"], got["routes"]] == fresh.routes(checkpoints[3]), (
                "the updated replica routes other than a fresh engine on the same checkpoint"
            )
            assert streamed_routes(stack, model) == got["routes"]

        serving = 3
        if sparse:  # one step back, as a trainer that publishes changed elements writes it
            identity = f"{family}-sparse"
            write_sparse_delta(
                checkpoints[3], checkpoints[2], tmp_path / identity, version=identity, base_version=prev_id
            )
            upload_dir(s3, tmp_path / identity, stack.bucket, f"{prefix}/{identity}")
            rep = publish(identity, prev_id, "sparse delta", 2)
            assert rep["verifiedTensors"] == changed_tensors(checkpoints[3], checkpoints[2])
            assert 0 < rep["swapBytes"]["pause_bytes"] <= SCATTER_OVERHEAD * rep["swapBytes"]["changed_bytes"]
            prev_id, serving = identity, 2

        bad = tmp_path / f"{family}-000004"
        cwtrain_write_delta(checkpoints[serving], checkpoints[5 - serving], bad, bad.name, prev_id)  # one step
        victim = corrupt_one_frame(bad)
        upload_dir(s3, bad, stack.bucket, f"{prefix}/{bad.name}")
        hl = hot_load(api, dep_id, bad.name, prev_id)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED", hl["status"]
        [rep] = hot_load_replicas(api, hl["spec"]["id"])
        assert rep["state"] == "ERROR" and victim in rep["errorReason"], rep
        assert_every_replica_serves(stack, dep_id, checkpoints[serving])
        assert through_gateway(stack, model) == fresh.answer(checkpoints[serving]), (
            "after a failed hot-load, the replica answers other than it did before it"
        )
        assert engines(stack, dep_id)[0]["enginePid"] == pid
        if tp > 1:  # the ranks are new processes: every socket they listen on is on the stack's host
            assert off_host_sockets(pid, stack.host) == []
            # Their embedding masked token ids uncompiled (replica/engine/plugin.py): no rank compiled.
            compiled = compiled_code(pid)
            assert not compiled, f"the engine's ranks compiled {len(compiled)} files with inductor: {compiled[:4]}"
        return figures
    finally:
        fresh.close()
        delete_deployment(api, dep_id)
