"""Metrics and traces out of the box, on the shared 3-replica deployment (real Dynamo vLLM
workers, real Temporal, real S3).

A FULL hot-load and a delta go through; then:
- each replica agent's Prometheus endpoint (its `metricsUrl`) counts two more pauses, READY, the
  snapshot it serves, bytes from the bucket on the first replica and from its peer on the
  others;
- the control worker's endpoint counts two more COMPLETED hot-loads, with their durations;
- the API's `/metrics` counts the two creates, by route template;
every endpoint scraped over HTTP and parsed with prometheus_client's parser.
- Traces: the stack's processes export spans over OTLP/HTTP to a real receiver that decodes the
  protobuf (tests/helpers/otlp_receiver.py): the delta's trace holds the API request's span and
  spans that the replica agent processes sent (service `rollouts-replica`), one per replica step.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.chains import publish_chain
from tests.helpers.prometheus import scrape, value
from tests.helpers.replicas import ROLLING_PREFIX, walk_order

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def published(stack, rolling, otlp, tmp_path_factory) -> dict:
    """One FULL and one delta hot-load, with every endpoint scraped and the receiver's span count
    taken before them (both tests read this one chain)."""
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    replicas = walk_order(stack, dep_id)
    assert all(r["metricsUrl"].startswith("http://") for r in replicas), replicas
    urls = {"worker": f"http://{stack.host}:{stack.ports['worker_metrics']}/metrics", "api": f"{stack.api_url}/metrics"}
    before = {r["name"]: scrape(r["metricsUrl"]) for r in replicas} | {k: scrape(u) for k, u in urls.items()}
    seen = len(otlp.spans())
    publish_chain(
        stack, api, dep_id, tmp_path_factory.mktemp("observed"), "ours", "observed", prefix=ROLLING_PREFIX, steps=1
    )
    return {"dep_id": dep_id, "replicas": replicas, "urls": urls, "before": before, "seen": seen}


def test_metrics_endpoints_count_a_hot_load(published):
    dep_id, replicas, before = published["dep_id"], published["replicas"], published["before"]
    worker_url, api_url = published["urls"]["worker"], published["urls"]["api"]
    worker_before, api_before = before["worker"], before["api"]

    for i, r in enumerate(replicas):
        now, was = scrape(r["metricsUrl"]), before[r["name"]]
        mine = {"deployment": dep_id, "replica": r["name"]}
        assert (
            value(now, "rollouts_replica_pause_seconds_count", **mine)
            - value(was, "rollouts_replica_pause_seconds_count", **mine)
            == 2
        )
        assert value(now, "rollouts_replica_state", **mine, state="READY") == 1
        assert value(now, "rollouts_replica_state", **mine, state="UPDATING") == 0
        assert value(now, "rollouts_replica_info", **mine, snapshot="observed-000001") == 1
        bucket = value(now, "rollouts_replica_bytes_total", source="bucket") - value(
            was, "rollouts_replica_bytes_total", source="bucket"
        )
        peer = value(now, "rollouts_replica_bytes_total", source="peer") - value(
            was, "rollouts_replica_bytes_total", source="peer"
        )
        if i == 0:
            assert bucket > 0 and peer == 0, (r["name"], bucket, peer)
            sent = value(now, "rollouts_replica_bytes_sent_total") - value(was, "rollouts_replica_bytes_sent_total")
            assert sent > 0
        else:
            assert bucket == 0 and peer > 0, (r["name"], bucket, peer)
        assert value(now, "rollouts_replica_step_failures_total") == value(was, "rollouts_replica_step_failures_total")

    worker_now = scrape(worker_url)
    done = "rollouts_hot_load_duration_seconds_count"
    assert value(worker_now, done, outcome="COMPLETED") - value(worker_before, done, outcome="COMPLETED") == 2
    assert (
        value(worker_now, "rollouts_hot_loads_ended_total", outcome="COMPLETED")
        - value(worker_before, "rollouts_hot_loads_ended_total", outcome="COMPLETED")
        == 2
    )
    api_now = scrape(api_url)
    route = {"method": "POST", "route": "/v1alpha1/inference/hotLoads", "status": "200"}
    assert (
        value(api_now, "rollouts_api_requests_total", **route)
        - value(api_before, "rollouts_api_requests_total", **route)
        == 2
    )
    assert (
        value(api_now, "rollouts_hot_loads_created_total") - value(api_before, "rollouts_hot_loads_created_total") == 2
    )


def test_replica_agents_export_their_spans_over_otlp(published, otlp):
    replicas, seen = len(published["replicas"]), published["seen"]
    # The API's span of each create roots its operation's trace; the agents' activity spans join
    # it. Spans are exported in batches: wait for them (the receiver's count, not a retry).
    deadline = time.monotonic() + 60
    while True:
        spans = otlp.spans()[seen:]
        roots = {
            s.trace_id for s in spans if s.service == "rollouts-api" and s.name == "POST /v1alpha1/inference/hotLoads"
        }
        agent = [
            s
            for s in spans
            if s.service == "rollouts-replica" and s.trace_id in roots and s.name.startswith("RunActivity:")
        ]
        # Per hot-load: the first replica's update, offer and send; each other one's stage and commit.
        if len(roots) == 2 and len(agent) >= 2 * (3 + 2 * (replicas - 1)):
            break
        assert time.monotonic() < deadline, (
            f"after 60 s the receiver has {len(roots)} new API root span(s) and {len(agent)} agent activity "
            f"span(s) in their traces ({otlp.requests} export requests in all)"
        )
        time.sleep(0.5)
    kinds = {s.name for s in agent}
    assert {
        "RunActivity:apply_snapshot",
        "RunActivity:offer_to_peer",
        "RunActivity:send_to_peers",
        "RunActivity:stage_from_peer",
        "RunActivity:commit_peer_stage",
    } <= kinds, kinds
    assert all(s.parent_span_id for s in agent)  # each joined its trace under a workflow span
