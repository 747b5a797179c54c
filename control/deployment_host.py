"""What the deployment workflow (control/deployment.py) provides the mixins it is made of
(`HotLoads`, control/deployment_hot_loads.py; `Autoscaler`, control/autoscaler.py): the
`DeploymentHost` protocol. Each mixin is typed as a `DeploymentHost` for mypy (`make lint`; its
base class under `TYPE_CHECKING`, `object` at run time: `MixinBase`), and control/deployment.py
assigns the workflow to a `type[DeploymentHost]`, so mypy proves it implements every method;
tests/control/test_host.py checks that its `__init__` sets every attribute.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from contracts.records import DeploymentInput, DeploymentSpec, ReplicaFailure


class DeploymentHost(Protocol):
    state: DeploymentInput
    deleting: bool
    failures: list[ReplicaFailure]
    # The node agents that did not answer the last check of the replica processes -> why.
    unanswered: dict[str, str]
    # One replica-set change at a time.
    replica_lock: asyncio.Lock

    @property
    def spec(self) -> DeploymentSpec: ...

    def _now(self) -> str: ...
    def _publish(self) -> None: ...
    def _settle(self) -> None: ...
    def _failure_of(self, name: str) -> str | None: ...
    def _not_ready(self) -> str: ...
    def _unanswered_text(self) -> str: ...
    async def _restart_lost_replicas(self, admitting: bool = False) -> list[str]: ...
    async def _start(
        self,
        names_: list[str],
        timeout: timedelta,
        pickup: timedelta = ...,
        attempts: int = 3,
        joining: bool = False,
        base: bool = False,
    ) -> Any: ...


if TYPE_CHECKING:
    MixinBase = DeploymentHost
else:
    MixinBase = object
