"""The gateway entity workflow: holds a gateway's spec and status until it is deleted.

In the embedded stack one gateway process serves every gateway object; its origin is each
gateway's `status.endpoints[0]`. The memo carries the wire object, so reads need no worker.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from contracts.records import Gateway, ResourceStatus, rfc3339


@workflow.defn
class GatewayWorkflow:
    @workflow.init
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.deleting = False

    @workflow.run
    async def run(self, gateway: Gateway) -> None:
        self.gateway.status.status = ResourceStatus.READY
        self.gateway.status.updated_at = rfc3339(workflow.now())
        workflow.upsert_memo({"gateway": self.gateway.wire()})
        await workflow.wait_condition(lambda: self.deleting)
        self.gateway.status.status = ResourceStatus.DELETING
        workflow.upsert_memo({"gateway": self.gateway.wire()})

    @workflow.update
    def delete(self) -> None:
        self.deleting = True
