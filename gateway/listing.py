"""The gateway's ``GET /v1/models`` answer.

Contract: ``model_list(views)`` takes the deployments a caller may see (``Router.models``: its
organization's, served by this gateway, ordered by model name then id) and returns OpenAI's list
with each model name once, as routing reads ``model``: a request naming it goes to the
deployments of that name, split by their weights. Each entry::

    {"id": name, "object": "model", "owned_by": "rollouts", "root": name,
     "takes_traffic": bool,
     "deployments": [{"deployment_id", "status", "takes_traffic", "weight",
                      "replicas": [{"name", "identity", "settled"}]}]}

``owned_by`` is the service (several deployments may serve one name); ``takes_traffic`` on the
entry is true when a request by that name would be served now (some deployment of it takes
traffic with weight above 0); each deployment (by id) says whether it takes traffic, its share
of the name's requests, and the snapshot identity each running replica serves. A deployment's id
is a ``model`` a request may also name (that deployment alone); it is not listed as an id.
"""

from __future__ import annotations

from typing import Any

from gateway.routing import DeploymentView


def _deployment(v: DeploymentView) -> dict[str, Any]:
    return {
        "deployment_id": v.deployment_id,
        "status": v.status,
        "takes_traffic": v.takes_traffic,
        "weight": v.weight,
        "replicas": [{"name": r.name, "identity": r.identity, "settled": r.settled} for r in v.replicas],
    }


def model_list(views: list[DeploymentView]) -> dict[str, Any]:
    """OpenAI's model list, one entry per model name (module docstring)."""
    by_name: dict[str, list[DeploymentView]] = {}
    for v in views:
        by_name.setdefault(v.model_name, []).append(v)
    data = [
        {
            "id": name,
            "object": "model",
            "owned_by": "rollouts",
            "root": name,
            "takes_traffic": any(v.takes_traffic and v.weight > 0 for v in deps),
            "deployments": [_deployment(v) for v in sorted(deps, key=lambda v: v.deployment_id)],
        }
        for name, deps in sorted(by_name.items())
    ]
    return {"object": "list", "data": data}
