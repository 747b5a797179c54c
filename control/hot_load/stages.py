"""Where a hot-load's receivers get their stage: the walk asks `ready(name)` before each commit.

`NoStages` (no peer transfer: everyone reads the bucket), `FanOut` (control/hot_load/fanout.py,
while the receivers fit in one group), or `GroupedStages` past `hotLoad.replicasPerGroup`: the
hot-load reaches each group's leader, then a `StageGroupWorkflow` child fans out to the rest, so
the hot-load's history holds a few events per group, not per transfer. All three implement the
`Stages` protocol: `add_root`, `ready`, `round`, `committed`, `abandon`, `end`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from temporalio import workflow
from temporalio.workflow import ChildWorkflowCancellationType, ParentClosePolicy

from control.hot_load.fanout import FanOut

with workflow.unsafe.imports_passed_through():
    from contracts import names
    from contracts.records import HotLoadSpec, ReplicaEndpoint, StageGroupInput, StageGroupResult


class Stages(Protocol):
    def add_root(self, root: ReplicaEndpoint, *, staged: bool) -> None:
        """A replica that holds the update now (the first, or one that committed) can send it."""

    async def ready(self, name: str) -> bool:
        """Whether `name` holds a stage to commit (False: it reads the bucket)."""

    def round(self, name: str) -> int | None:
        """The fan-out round `name`'s stage came in, if it came from a peer."""

    def committed(self, name: str) -> None:
        """`name` committed: its stage is spent."""

    def abandon(self) -> None:
        """The walk stops: no more transfers start."""

    async def end(self) -> None:
        """Wait for what is still running to finish."""


class NoStages:
    def add_root(self, root: ReplicaEndpoint, *, staged: bool) -> None:
        pass

    async def ready(self, name: str) -> bool:
        return False

    def round(self, name: str) -> int | None:
        return None

    def committed(self, name: str) -> None:
        pass

    def abandon(self) -> None:
        pass

    async def end(self) -> None:
        pass


class OneFanOut(FanOut):
    """The fan-out of a hot-load whose receivers fit in one group."""

    def add_root(self, root: ReplicaEndpoint, *, staged: bool) -> None:
        self.add(root, staged=staged)


class GroupedStages:
    def __init__(
        self,
        spec: HotLoadSpec,
        receivers: list[ReplicaEndpoint],
        serving: dict[str, str],
        *,
        fan_out: int,
        group_size: int,
        workflow_id: str,
    ) -> None:
        self.spec, self.serving, self.fan_out, self.workflow_id = spec, serving, fan_out, workflow_id
        self.groups = [receivers[i : i + group_size] for i in range(0, len(receivers), group_size)]
        self.leaders = FanOut(spec, [g[0] for g in self.groups], serving, fan_out)
        self.group_of = {member.name: j for j, g in enumerate(self.groups) for member in g[1:]}
        self.root: ReplicaEndpoint | None = None
        self.results: list[asyncio.Future[StageGroupResult | None]] = []

    def add_root(self, root: ReplicaEndpoint, *, staged: bool) -> None:
        if self.root is None:
            self.root = root
            self.results = [asyncio.ensure_future(self._group(j, g)) for j, g in enumerate(self.groups)]
        self.leaders.add(root, staged=staged)

    async def _group(self, j: int, group: list[ReplicaEndpoint]) -> StageGroupResult | None:
        """Group j's stages: its leader's from the hot-load's fan-out, the others' from its child."""
        leader, members = group[0], group[1:]
        if not members:
            return StageGroupResult()
        assert self.root is not None
        staged = await self.leaders.ready(leader.name)
        source = leader if staged else self.root
        try:
            outcome: StageGroupResult = await workflow.execute_child_workflow(
                names.STAGE_GROUP_WORKFLOW,
                StageGroupInput(
                    spec=self.spec,
                    members=members,
                    serving={m.name: self.serving.get(m.name, "") for m in members},
                    source=source,
                    source_staged=True,
                    source_round=self.leaders.round(leader.name) or 0,
                    fan_out=self.fan_out,
                ),
                id=names.stage_group_workflow_id(self.workflow_id, j),
                result_type=StageGroupResult,
                static_summary=f"stage {self.spec.identity} on {len(members)} replica(s) from {source.name}",
                cancellation_type=ChildWorkflowCancellationType.TRY_CANCEL,
                parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
            )
            return outcome
        except Exception as exc:  # noqa: BLE001 - its members read the bucket (a cancel is not an Exception)
            workflow.logger.warning(
                "stage group %d of %s failed (%s): its replicas read the bucket", j, self.spec.id, exc
            )
            return None

    async def ready(self, name: str) -> bool:
        j = self.group_of.get(name)
        if j is None:
            return await self.leaders.ready(name)
        result = await self.results[j]
        return result is not None and name in result.staged

    def round(self, name: str) -> int | None:
        j = self.group_of.get(name)
        if j is None:
            return self.leaders.round(name)
        task = self.results[j]
        result = task.result() if task.done() and not task.cancelled() and task.exception() is None else None
        return result.staged.get(name) if result is not None else None

    def committed(self, name: str) -> None:
        self.leaders.committed(name)

    def abandon(self) -> None:
        self.leaders.abandon()
        for task in self.results:
            if not task.done():
                task.cancel()

    async def end(self) -> None:
        await self.leaders.end()
        for task in self.results:
            await task
