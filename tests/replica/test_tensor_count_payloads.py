"""What grows with a model's tensor count stays under the limits of what carries it.

An RPC too large for a request body travels as a file (replica/rpc_file.py): the agent's stage
request for a delta that changes every tensor of an 18,867-tensor model (Qwen3-30B-A3B's count)
is about 4 MB of JSON, past the 2 MB body limit of NVIDIA Dynamo's system server (it answered 413
and the hot-load failed). Here the agent's real client (`EngineClient`) talks to a server that
refuses bodies over 2 MB as Dynamo's does and hands each call to the engine's real extension
(`WeightLoaderExtension.call_from_file`), whose stage method records what arrived. No vLLM.

A peer offer of every tensor (contracts/activities.py ``PeerOffer``) crosses Temporal packed: at
about 70,000 tensors (Kimi-K2's count) its payload stays under Temporal's 2 MB limit and arrives
whole."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from temporalio.contrib.pydantic import pydantic_data_converter

from contracts.activities import PeerOffer, StageFromPeerInput
from replica import rpc_file
from replica.agent.engine_rpc import EngineClient
from replica.engine.extension import WeightLoaderExtension

DYNAMO_BODY_LIMIT = 2 * 1024 * 1024
TENSORS = 18_867


class Recorder(WeightLoaderExtension):
    """The extension with its stage job replaced by a record of the arguments it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def stage_from_arena(self, *args, **kwargs):
        self.calls.append(("stage_from_arena", args, kwargs))
        return {"kind": "stage", "state": "running", "result_path": None}

    def job_status(self, kind=None):
        return {"kind": "stage", "state": "done", "result": {"staged": self.calls[-1][1][0]}, "error": None}


def serve(ext: Recorder, bodies: list[int]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(len(request.content))
        if len(request.content) > DYNAMO_BODY_LIMIT:
            return httpx.Response(413, text="Failed to buffer the request body: length limit exceeded")
        call = json.loads(request.content)
        result = getattr(ext, call["method"])(*call["args"], **call["kwargs"])
        return httpx.Response(200, json={"results": [result]})

    return httpx.MockTransport(handle)


def every_tensor() -> tuple[list[list], dict[str, str], dict[str, int]]:
    names = [f"model.layers.{i // 393}.mlp.experts.{i % 128}.down_proj.weight.{i}" for i in range(TENSORS)]
    entries = [[n, "bfloat16", [64, 32], 4096 * i] for i, n in enumerate(names)]
    return entries, {n: f"{i:08x}" for i, n in enumerate(names)}, {n: 4096 * i for i, n in enumerate(names)}


def test_a_stage_of_every_tensor_of_an_18867_tensor_model_reaches_the_engine_whole(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ROLLOUTS_SHM_DIR", str(tmp_path))
    ext, bodies = Recorder(), []
    client = EngineClient("http://engine")
    monkeypatch.setattr(
        client, "_client", lambda: httpx.AsyncClient(base_url="http://engine", transport=serve(ext, bodies))
    )
    entries, expected, offsets = every_tensor()
    # The premise: sent as a request body, this call is past the server's limit.
    direct = rpc_file.encode(
        "stage_from_arena", ["delta-1", "/dev/shm/arena", entries, expected, True, "/dev/shm/host", offsets], {}
    )
    assert len(direct) > DYNAMO_BODY_LIMIT

    result = asyncio.run(
        client.stage_from_arena("delta-1", "/dev/shm/arena", entries, expected, backup=("/dev/shm/host", offsets))
    )

    assert result == {"staged": "delta-1"}
    ((method, args, _),) = ext.calls
    assert method == "stage_from_arena"
    assert args == ("delta-1", "/dev/shm/arena", entries, expected, True, "/dev/shm/host", offsets)
    assert max(bodies) <= rpc_file.BODY_LIMIT
    assert list(tmp_path.iterdir()) == []  # the call's file is removed once the engine answered


def test_a_small_call_is_a_request_body_and_a_call_file_names_only_public_methods(tmp_path) -> None:
    ext, bodies = Recorder(), []
    client = EngineClient("http://engine")
    client._client = lambda: httpx.AsyncClient(base_url="http://engine", transport=serve(ext, bodies))
    asyncio.run(client.stage_from_arena("small", "/dev/shm/arena", [["w", "bfloat16", [2], 0]], {"w": "00000001"}))
    assert ext.calls[0][1][2] == [["w", "bfloat16", [2], 0]]
    assert len(bodies) == 2  # the stage and one job_status, as bodies

    for method in ("_weight_map", "call_from_file", ""):
        path = rpc_file.write_call(tmp_path, rpc_file.encode(method, [], {}))
        with pytest.raises(ValueError, match="refusing method"):
            Recorder().call_from_file(str(path))
    with pytest.raises(ValueError, match="no extension method"):
        Recorder().call_from_file(str(rpc_file.write_call(tmp_path, rpc_file.encode("execute_model", [], {}))))
    stray = tmp_path / "elsewhere.json"
    stray.write_text("{}")
    with pytest.raises(ValueError, match="not a rollouts-rpc-"):
        Recorder().call_from_file(str(stray))


TEMPORAL_PAYLOAD_LIMIT = 2 * 1024 * 1024


def offer(tensors: int) -> PeerOffer:
    specs = [
        [f"model.layers.{i // 1161}.mlp.experts.{i % 384}.down_proj.weight", "bfloat16", [64, 32]]
        for i in range(tensors)
    ]
    return PeerOffer(
        source_replica="replica-0",
        host="10.0.0.1",
        port=29500,
        backend="gloo",
        base_identity="*",
        identity="full-1",
        chain=[],
        specs=specs,
        expected_adler32={s[0]: f"{i:08x}" for i, s in enumerate(specs)},
    )


def test_an_offer_of_70000_tensors_crosses_temporal_whole_under_its_payload_limit() -> None:
    sent = StageFromPeerInput(offer=offer(70_824), rank=1)
    as_json = len(json.dumps({"specs": sent.offer.specs, "expected": sent.offer.expected_adler32}))
    assert as_json > TEMPORAL_PAYLOAD_LIMIT  # the premise: as plain JSON it would be refused

    async def round_trip():
        payloads = await pydantic_data_converter.encode([sent])
        (back,) = await pydantic_data_converter.decode(payloads, [StageFromPeerInput])
        return len(payloads[0].data), back

    size, back = asyncio.run(round_trip())
    assert size < TEMPORAL_PAYLOAD_LIMIT
    assert back.offer.specs == sent.offer.specs and back.offer.expected_adler32 == sent.offer.expected_adler32
    # A small offer travels as it always did.
    small = offer(3).model_dump(mode="json", by_alias=True)
    assert "packed" not in small and len(small["specs"]) == 3
