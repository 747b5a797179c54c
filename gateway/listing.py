"""The gateway's ``GET /v1/models`` answer.

``model_list(views)`` takes the deployments a caller may see (``Router.models``) and returns
OpenAI's list with each model name once::

    {"id": name, "object": "model", "owned_by": "rollouts", "root": name,
     "takes_traffic": bool,
     "deployments": [{"deployment_id", "status", "takes_traffic", "weight",
                      "replicas": [{"name", "identity", "settled"}]}]}

An entry ``takes_traffic`` when a request by that name would be served now. A deployment's id
is also a ``model`` a request may name, but is not listed as an id.
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
