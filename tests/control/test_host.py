"""The deployment workflow provides every member of `DeploymentHost` (control/deployment_host.py),
the protocol its mixins (`HotLoads`, `Autoscaler`) are typed against: methods and properties on
the class, attributes assigned in its `__init__`."""

from __future__ import annotations

import inspect

from control.deployment import DeploymentWorkflow
from control.deployment_host import DeploymentHost


def test_the_deployment_workflow_provides_every_member_of_its_mixins_host():
    members = {n for n in vars(DeploymentHost) if not n.startswith("__") or n == "__init__"} - {"__init__"}
    members = {n for n in members if not n.startswith("_abc") and n not in ("_is_protocol", "_is_runtime_protocol")}
    attributes = set(DeploymentHost.__annotations__)
    assert attributes and members - attributes, (attributes, members)
    init = inspect.getsource(DeploymentWorkflow.__init__)
    for name in attributes:
        assert f"self.{name} =" in init or f"self.{name}: " in init, f"DeploymentWorkflow.__init__ does not set {name}"
    for name in members - attributes:
        assert callable(getattr(DeploymentWorkflow, name, None)) or isinstance(
            inspect.getattr_static(DeploymentWorkflow, name, None), property
        ), f"DeploymentWorkflow lacks {name}"
