"""Starting and stopping a deployment's replicas where the node registry places them (workflow
code: the deployment workflow, control/deployment.py, calls these from its handlers and loop).

- `start`: members without a placement are placed first (`place_replicas`: all-or-nothing; not
  enough capacity raises `PlacementFailed`, naming what is missing); then each node agent starts
  its share (`start_replicas` on `nodes/NAME`, all nodes at once). A node that does not pick its
  start up within `NODE_PICKUP` is reported, not waited for: the registry declares it lost.
  Returns the names started and, per node, why its start failed.
- `stop`: each node agent stops its share, then the registry releases the placements. A node that
  is gone cannot stop anything; the placements are released all the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts import names
    from contracts.activities import StartReplicasInput, StopReplicasInput
    from contracts.errors import FAILED_PRECONDITION
    from contracts.nodes import PlaceRequest, ReleaseRequest
    from contracts.records import DeploymentInput, Placement

# How long a start or stop waits for its node agent to pick it up (a hot-load's admission waits
# less: `ADMISSION_PICKUP`).
NODE_PICKUP = timedelta(seconds=60)
ADMISSION_PICKUP = timedelta(seconds=10)
# The deployment's periodic check of its replica processes, and an admission's: one attempt of
# at most CHECK_TIMEOUT per node (starting a process takes a second; the next check is the
# retry), so the replica lock is never held long by a node that took the task and went silent.
CHECK_PICKUP = timedelta(seconds=15)
CHECK_TIMEOUT = timedelta(seconds=20)


class PlacementFailed(Exception):
    """The registry could not place every replica asked for (the message says what is missing)."""


@dataclass
class StartOutcome:
    started: list[str] = field(default_factory=list)
    # node -> why its start failed
    failed: dict[str, str] = field(default_factory=dict)

    def failures(self) -> str:
        """Why each node's start failed, in one line ("node N: why; ...")."""
        return "; ".join(f"node {n}: {why}" for n, why in self.failed.items())


def _cause(exc: BaseException) -> str:
    cause = exc.cause if isinstance(exc, ActivityError) and exc.cause is not None else exc
    return cause.message if isinstance(cause, ApplicationError) else str(cause)


def by_node(state: DeploymentInput, names_: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in names_:
        placement = state.placements.get(name)
        if placement is not None:
            out.setdefault(placement.node, []).append(name)
    return dict(sorted(out.items()))


async def place(state: DeploymentInput, names_: list[str], zone: str) -> None:
    """Give every one of `names_` without a placement one (all or none)."""
    unplaced = [n for n in names_ if n not in state.placements]
    if not unplaced:
        return
    try:
        placed = await workflow.execute_activity(
            names.PLACE_REPLICAS,
            PlaceRequest(
                deployment_workflow_id=workflow.info().workflow_id,
                replicas=unplaced,
                gpus_per_replica=state.deployment.spec.resources.gpu_count,
                zone=zone,
            ),
            result_type=dict[str, Placement],
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=5, non_retryable_error_types=[FAILED_PRECONDITION]),
            summary=f"place {', '.join(unplaced)}",
        )
    except ActivityError as exc:
        raise PlacementFailed(_cause(exc)) from None
    state.placements.update(placed)


async def start(
    state: DeploymentInput,
    names_: list[str],
    make_input: Callable[[list[str]], StartReplicasInput],
    zone: str,
    timeout: timedelta,
    pickup: timedelta = NODE_PICKUP,
    attempts: int = 3,
) -> StartOutcome:
    await place(state, names_, zone)
    groups = by_node(state, names_)
    results = await asyncio.gather(
        *(
            workflow.execute_activity(
                names.START_REPLICAS,
                make_input(group),
                task_queue=names.node_task_queue(node),
                start_to_close_timeout=timeout,
                schedule_to_start_timeout=pickup,
                retry_policy=RetryPolicy(maximum_attempts=attempts),
                summary=f"start {', '.join(group)} on node {node}",
            )
            for node, group in groups.items()
        ),
        return_exceptions=True,
    )
    outcome = StartOutcome()
    for (node, _group), result in zip(groups.items(), results):
        if isinstance(result, BaseException):
            outcome.failed[node] = _cause(result)
        else:
            outcome.started += list(result)
    return outcome


async def stop(state: DeploymentInput, names_: list[str]) -> None:
    """Stop these replicas and give their places back; never raises (logged)."""
    deployment_id = state.deployment.spec.id
    groups = by_node(state, names_)
    results = await asyncio.gather(
        *(
            workflow.execute_activity(
                names.STOP_REPLICAS,
                StopReplicasInput(deployment_id=deployment_id, names=group),
                task_queue=names.node_task_queue(node),
                start_to_close_timeout=timedelta(minutes=2),
                schedule_to_start_timeout=NODE_PICKUP,
                retry_policy=RetryPolicy(maximum_attempts=5),
                summary=f"stop {', '.join(group)} on node {node}",
            )
            for node, group in groups.items()
        ),
        return_exceptions=True,
    )
    for (node, group), result in zip(groups.items(), results):
        if isinstance(result, BaseException):
            workflow.logger.warning("stopping %s on node %s failed: %s", ", ".join(group), node, _cause(result))
    try:
        await workflow.execute_activity(
            names.RELEASE_REPLICAS,
            ReleaseRequest(deployment_workflow_id=workflow.info().workflow_id, replicas=names_),
            result_type=int,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=5),
        )
    except ActivityError as exc:
        workflow.logger.warning("releasing the places of %s failed: %s", ", ".join(names_), _cause(exc))
    for name in names_:
        state.placements.pop(name, None)
