"""What every route of the API shares, per app: one `ApiContext` on `app.state.context`.

Routes reach it with the dependency `context` (a parameter `ctx: ContextDep`), and the
Temporal-backed reads and writes with `resources` (`r: ResourcesDep`), which answers unavailable ("the API is
starting") until the app's lifespan has connected them. `resources` and `cancel_wait_s` live on
`app.state` itself, where api/app.py sets them and tests and benches read or change them; the
context reads them there on each use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.datastructures import State

from api.resources import Resources
from common.settings import Settings
from contracts.errors import Unavailable
from contracts.tokens import TokenStore


@dataclass(frozen=True)
class ApiContext:
    settings: Settings
    tokens: TokenStore
    # Engines whose deployments may hot-load (api/app.py: allowed_hot_load_engines).
    hot_load_engines: tuple[str, ...]
    # The app's state: `resources` once started, `cancel_wait_s`.
    app_state: State

    @property
    def resources(self) -> Resources:
        resources = getattr(self.app_state, "resources", None)
        if resources is None:
            raise Unavailable("the API is starting")
        return resources

    @property
    def cancel_wait_s(self) -> float:
        """How long a cancel waits for its hot-load to end before answering (api/routes/hot_loads.py)."""
        return self.app_state.cancel_wait_s


def context(request: Request) -> ApiContext:
    return request.app.state.context


# A route's parameter `ctx: ContextDep` is the app's context.
ContextDep = Annotated[ApiContext, Depends(context)]


def resources(ctx: ContextDep) -> Resources:
    return ctx.resources


# A route's parameter `r: ResourcesDep` is the Temporal-backed reads and writes.
ResourcesDep = Annotated[Resources, Depends(resources)]
