"""A stage group (type `StageGroupWorkflow`, id `hotLoads/ORG/ID/stage-J`): one child workflow per
group of a large hot-load's receivers, so that no workflow's history grows with the deployment.

The hot-load passes the update to each group's first member, then the group fans it out to the
rest (control/hot_load/fanout.py; from `source` if the first did not stage) and returns which
members hold a checked stage and in which round. Invariants: a group only stages (nothing any
member serves changes; the replica entries are the hot-load's); a cancel abandons every transfer.
"""

from __future__ import annotations

from temporalio import workflow

from control.hot_load.fanout import FanOut

with workflow.unsafe.imports_passed_through():
    from contracts import names
    from contracts.records import StageGroupInput, StageGroupResult


@workflow.defn(name=names.STAGE_GROUP_WORKFLOW)
class StageGroupWorkflow:
    @workflow.init
    def __init__(self, inp: StageGroupInput) -> None:
        self.fan = FanOut(inp.spec, inp.members, inp.serving, inp.fan_out)

    @workflow.query
    def staged(self) -> StageGroupResult:
        return self._result()

    @workflow.run
    async def run(self, inp: StageGroupInput) -> StageGroupResult:
        fan = self.fan
        fan.add(inp.source, staged=inp.source_staged, round=inp.source_round, from_peer=inp.source_round > 0)
        fan.close()
        total = len(inp.members)
        try:
            for member in inp.members:
                await fan.ready(member.name)
                workflow.set_current_details(
                    f"{len(fan.rounds)}/{total} staged from peers, {len(fan.outcomes) - len(fan.rounds)} to read "
                    "the bucket"
                )
            await fan.end()
        except BaseException:
            fan.abandon()
            raise
        return self._result()

    def _result(self) -> StageGroupResult:
        return StageGroupResult(
            staged=dict(self.fan.rounds),
            failed={n: self.fan.errors.get(n, "") for n, ok in self.fan.outcomes.items() if not ok},
        )
