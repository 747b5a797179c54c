"""Routing views built from deployment memos as the workflows publish them, and a router serving
them, for the gateway's routing tests (no stack, no engine)."""

from __future__ import annotations

from gateway.routing import Router, build_view

GW = "gw-a"


def view(
    dep_id: str,
    model: str = "policy",
    *,
    replicas: int = 1,
    status: str = "STATUS_READY",
    weight: object = 100,
    gateways: tuple[str, ...] = (GW,),
    org: str = "org",
):
    memo = {
        "deployment": {
            "spec": {
                "id": dep_id,
                "organizationId": org,
                "gatewayIds": list(gateways),
                "model": {"name": model},
                "traffic": {"weight": weight},
            },
            "status": {"status": status},
        },
        "replicas": [
            {"name": f"{dep_id}-r{i}", "engineUrl": f"http://127.0.0.1:{9000 + i}/{dep_id}"} for i in range(replicas)
        ],
    }
    v = build_view(memo, f"deployments/{org}/{dep_id}", None)
    assert v is not None
    return v


def router(*views) -> Router:
    r = Router(gateway_id=GW)
    for v in views:
        r.set_view(v)
    return r
