"""Who asks, and what they may do: every request under `PREFIX` is authenticated before anything
else is looked at.

`authenticate` (an HTTP middleware) maps the Bearer token to a `Principal` (organization and
role: contracts/tokens.py): a missing or unknown token answers unauthenticated, and a viewer's write
answers permission_denied naming the write (`write_action`), even when its body is invalid or
oversized. Routes take the principal with `p: PrincipalDep` (`Depends(principal)`).

Where deployments read (common/buckets.py): `require_granted` answers permission_denied naming the
field when a bucket or path is not granted to the caller's organization in the tokens file.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.responses import JSONResponse

from api.context import ContextDep, context
from common.buckets import grant_problem
from contracts.errors import ApiError, PermissionDenied
from contracts.records import HotLoadConfig, ModelSource
from contracts.tokens import Principal

# The resources' routes (api/app.py mounts them here); every request under it takes a token.
PREFIX = "/v1alpha1/inference"
READ_METHODS = ("GET", "HEAD", "OPTIONS")
# What each write is called in a permission_denied message; any other write is "this request".
WRITE_ACTIONS: list[tuple[str, re.Pattern[str], str]] = [
    ("POST", re.compile(r"^/gateways/?$"), "creating a gateway"),
    ("DELETE", re.compile(r"^/gateways/[^/]+$"), "deleting a gateway"),
    ("POST", re.compile(r"^/deployments/?$"), "creating a deployment"),
    ("PATCH", re.compile(r"^/deployments/[^/]+$"), "updating a deployment"),
    ("DELETE", re.compile(r"^/deployments/[^/]+$"), "deleting a deployment"),
    ("POST", re.compile(r"^/hotLoads/?$"), "creating a hot-load"),
    ("POST", re.compile(r"^/hotLoads/[^/]+:cancel$"), "canceling a hot-load"),
]


def write_action(method: str, path: str) -> str:
    """What the write `method path` (path below `PREFIX`) is called in a permission_denied message."""
    for m, pattern, action in WRITE_ACTIONS:
        if m == method and pattern.match(path):
            return action
    return "this request"


async def authenticate(request: Request, call_next):
    path = request.url.path
    if path.startswith(PREFIX + "/"):
        try:
            who = context(request).tokens.authenticate(request.headers.get("authorization"))
            if request.method not in READ_METHODS:
                who.require_admin(write_action(request.method, path[len(PREFIX) :]))
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.http_status)
        request.state.principal = who
    return await call_next(request)


def principal(ctx: ContextDep, request: Request, authorization: str | None = Header(default=None)) -> Principal:
    who = getattr(request.state, "principal", None)
    return who if who is not None else ctx.tokens.authenticate(authorization)


# A route's parameter `p: PrincipalDep` is the caller, authenticated.
PrincipalDep = Annotated[Principal, Depends(principal)]


def require_granted(p: Principal, model: ModelSource | None, hot_load: HotLoadConfig | None) -> None:
    """permission_denied naming the field when the organization may not read there (common/buckets.py)."""
    checks = []
    if model is not None:
        checks.append(("model.bucket", model.bucket, "model.path", model.path))
    if hot_load is not None:
        checks.append(("hotLoad.bucket", hot_load.bucket, "hotLoad.pathPrefix", hot_load.path_prefix))
    for bucket_field, bucket, path_field, path in checks:
        if problem := grant_problem(p.buckets, p.organization_id, bucket_field, bucket, path_field, path):
            raise PermissionDenied(problem)
