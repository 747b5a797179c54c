"""Generated requests (hypothesis) against every operation of the API's OpenAPI document, served
in process on the real Temporal dev server with a READY deployment: at least 1,000 requests, zero
5xx, every answer the `{"code", "message", "details"}` shape or a success, never a traceback.

Bodies mix the fields the API knows (with right and wrong values: unknown enum names, numbers,
wrong types, oversized strings, path traversal) with arbitrary JSON and non-JSON; ids mix real
ones with arbitrary text; tokens are admin, viewer, another organization's, garbage or none.
Valid creates are admitted and run (test replicas), so cancel, listing and already-in-progress
paths are exercised too.

Hypothesis drives synchronous code, so the control plane (workers and API) runs on an event
loop of its own in a background thread for this test.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from api.app import PREFIX
from tests.helpers.harness import ADMIN, DISABLED_ORG, OTHER_ORG, VIEWER, Fleet, write_full

EXAMPLES = 1100  # a few (DELETE of the live deployment) are skipped; >= 1000 are sent

ENDPOINTS = [
    ("GET", "/gateways/parameters"),
    ("GET", "/gateways"),
    ("POST", "/gateways"),
    ("GET", "/gateways/{id}"),
    ("DELETE", "/gateways/{id}"),
    ("GET", "/deployments/parameters"),
    ("GET", "/deployments"),
    ("POST", "/deployments"),
    ("GET", "/deployments/{id}"),
    ("PATCH", "/deployments/{id}"),
    ("DELETE", "/deployments/{id}"),
    ("GET", "/hotLoads"),
    ("POST", "/hotLoads"),
    ("GET", "/hotLoads/{id}"),
    ("GET", "/hotLoads/{id}/replicas"),
    ("POST", "/hotLoads/{id}:cancel"),
]

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.just("x" * 5000),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
identity = st.one_of(
    st.sampled_from(["s1", "step-000001", "initial", "..", "../../etc/passwd", "a/b", "", "x" * 129, "é", "s1\x00"]),
    st.text(max_size=140),
    junk,
)
enum_value = lambda *names: st.one_of(  # noqa: E731
    st.sampled_from(list(names)), st.integers(-2, 5), st.sampled_from(["FULL", "SNAPSHOT_TYPE_WHOLE", "1"]), junk
)


def maybe(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts with any subset of `fields`, sometimes an unknown one too."""
    return st.fixed_dictionaries({}, optional={**fields, "surprise": junk})


def bodies(dep_ids: list[str]) -> st.SearchStrategy[Any]:
    meta = maybe(
        {
            "previousSnapshotIdentity": identity,
            "compressionFormat": enum_value("COMPRESSION_FORMAT_ZSTD", "COMPRESSION_FORMAT_LZ4"),
            "checksumFormat": enum_value("CHECKSUM_FORMAT_ADLER32", "CHECKSUM_FORMAT_XXH3_128"),
        }
    )
    hot_load = maybe(
        {
            "deploymentId": st.one_of(st.sampled_from(dep_ids), identity),
            "hotLoadId": st.one_of(st.uuids().map(str), identity),
            "identity": identity,
            "type": enum_value("SNAPSHOT_TYPE_FULL", "SNAPSHOT_TYPE_INCREMENTAL"),
            "incrementalSnapshotMetadata": st.one_of(meta, junk),
            "promptCachePolicy": enum_value("PROMPT_CACHE_POLICY_PRESERVE", "PROMPT_CACHE_POLICY_RESET_ALL"),
        }
    )
    hot_load_section = maybe(
        {
            "bucket": st.one_of(st.just("rollouts"), identity),
            "pathPrefix": st.one_of(st.just(f"ckpt/{dep_ids[0]}"), identity),
            "transitionMode": enum_value("TRANSITION_MODE_ASYNC"),
        }
    )
    deployment = maybe(
        {
            "id": identity,
            "name": identity,
            "gatewayIds": st.one_of(st.lists(identity, max_size=3), junk),
            "runtime": st.one_of(
                maybe(
                    {
                        "engine": st.sampled_from(["dynamo-vllm", "vllm"]),
                        "version": identity,
                        "engineConfig": st.one_of(
                            st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3), junk
                        ),
                    }
                ),
                junk,
            ),
            "model": st.one_of(maybe({"name": identity, "bucket": identity, "path": identity}), junk),
            "autoscaling": st.one_of(maybe({"min": st.integers(-1, 20), "max": st.integers(-1, 20)}), junk),
            "traffic": st.one_of(maybe({"weight": st.one_of(st.integers(-5, 500), junk)}), junk),
            "hotLoad": st.one_of(hot_load_section, junk),
            "resources": st.one_of(maybe({"instanceType": identity, "gpuCount": st.integers(-1, 9)}), junk),
        }
    )
    gateway = maybe({"id": identity, "name": identity, "zones": st.one_of(st.lists(identity, max_size=3), junk)})
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=10),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=8,
    )
    return st.one_of(hot_load, deployment, gateway, json_values)


class Background:
    """An event loop in a thread, running the control plane for a synchronous test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_generated_requests_never_answer_5xx(temporal_env, tmp_path: Path):
    target = temporal_env.client.service_client.config.target_host
    bg = Background()

    async def up() -> tuple[Fleet, str, str]:
        client = await Client.connect(target, data_converter=pydantic_data_converter)
        fleet = Fleet(client, tmp_path)
        await fleet.__aenter__()
        dep = await fleet.ready_deployment()
        for name in ("s1", "step-000001", "é"):
            write_full(fleet.bucket_root / f"ckpt/{dep}", name)
        hl = (await fleet.completed(dep, "s1"))["spec"]["id"]
        return fleet, dep, hl

    fleet, dep, hl = bg.run(up())
    routes = {(m.upper(), p.removeprefix(PREFIX)) for p, ops in fleet.app.openapi()["paths"].items() for m in ops}
    assert routes == {
        (
            m,
            p.replace(
                "{id}",
                "{"
                + (
                    "gateway_id"
                    if p.startswith("/gateways")
                    else "deployment_id"
                    if p.startswith("/deployments")
                    else "hot_load_id"
                )
                + "}",
            ),
        )
        for m, p in ENDPOINTS
    }, "a new operation: add it to ENDPOINTS"
    answers: list[int] = []

    async def send(
        method: str, path: str, token: str | None, params: dict, body: Any, raw: bool
    ) -> tuple[int, str, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        kw: dict[str, Any] = {"params": params, "headers": headers}
        if method in ("POST", "PATCH"):
            if raw:
                kw["content"] = str(body).encode("utf-8", "surrogatepass")
                headers["content-type"] = "application/json"
            else:
                kw["json"] = body
        r = await fleet.http.request(method, path, **kw)
        try:
            parsed = r.json()
        except ValueError:
            parsed = None
        return r.status_code, r.text, parsed

    try:
        # derandomize: the same 1,100 requests every run, so `make test` is repeatable.
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.function_scoped_fixture,
                HealthCheck.data_too_large,
            ],
        )
        @given(
            endpoint=st.sampled_from(ENDPOINTS),
            some_id=st.one_of(st.sampled_from([dep, hl, "gw", "nope"]), identity.filter(lambda v: isinstance(v, str))),
            token=st.sampled_from([ADMIN, ADMIN, VIEWER, OTHER_ORG, DISABLED_ORG, "garbage", None]),
            params=maybe(
                {
                    "parentDeploymentId": st.one_of(st.just(dep), st.text(max_size=20)),
                    "maxPageSize": st.one_of(st.integers(-5, 5000), st.text(max_size=5)),
                    "pageToken": st.text(max_size=30),
                    "parentGatewayId": st.text(max_size=10),
                }
            ),
            body=bodies([dep]),
            raw=st.booleans(),
        )
        def one_request(endpoint, some_id, token, params, body, raw) -> None:
            method, template = endpoint
            path = template.replace("{id}", quote(some_id, safe="") or "x")
            # The live deployment stays: deleting it would make the rest of the run trivial.
            if method == "DELETE" and some_id == dep:
                return
            status, text, parsed = bg.run(send(method, path, token, params, body, raw and method != "GET"))
            answers.append(status)
            assert status < 500, (method, path, params, body, status, text[:500])
            assert "Traceback" not in text
            if status >= 400:
                assert isinstance(parsed, dict) and set(parsed) == {"code", "message", "details"}, text[:300]
                assert parsed["message"], parsed

        one_request()
    finally:
        bg.run(fleet.__aexit__(None, None, None))
        bg.close()
    assert len(answers) >= 1000, len(answers)
    codes = {s // 100 for s in answers}
    assert {2, 4} <= codes, sorted(set(answers))
    print(
        f"{len(answers)} generated requests: "
        + ", ".join(f"{c}xx {sum(1 for s in answers if s // 100 == c)}" for c in sorted(codes))
    )
