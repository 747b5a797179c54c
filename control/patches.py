"""Every workflow patch of control/, with its stage and the recorded histories that prove it.

A patch (Temporal's `workflow.patched(id)`) lets workflow code change while open histories keep
replaying: a deployment workflow runs for as long as its deployment exists, across upgrades. Its
lifecycle (as in temporalio/samples-python's patching sample):

- **patched**: `workflow.patched(ID)` picks the new code for a new history (which records the
  marker) and the old code for a history recorded without it. Both branches stay.
- **deprecated**: `workflow.deprecate_patch(ID)`: only the new code remains; a history that
  recorded the marker still replays. Drop the call once no open history can hold the marker
  (`rollouts history check` over the open deployments' exported histories says so).
- **removable**: no call left; listed until the next release notes say it is gone.

`PATCHES` is the table; each `Patch.proof` names the histories in tests/histories that replay
across it (tests/ops/test_history_check.py replays them; tests/control/test_patches.py checks
that every patch call in control/ is listed here at its stage, and that each proof history
exists and holds or lacks the marker as its stage says). Workflow code imports the ids from
here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Stage = Literal["patched", "deprecated", "removable"]

# The ids, as workflow code passes them to workflow.patched / workflow.deprecate_patch.
ORG_SCOPED_IDS = "org-scoped-ids"
ADMISSION_CHECKS_REPLICAS = "admission-checks-replicas"
NODE_PLACEMENT = "node-placement"
ADMISSION_AT_ONCE = "admission-checks-at-once"
SNAPSHOTS_CHECKED_ONCE = "snapshot-checks-once"
OUTCOME_NOTED_ONCE = "outcome-noted-once"
PEER_JOIN = "autoscaling-peer-join"
ADMISSION_RECHECKS_NODES = "admission-rechecks-nodes"

# tests/histories files (deployment workflow histories).
_NOW = "deployments%2Forg-a%2Fhistory-dep.json"
_BEFORE_NODES = "deployments%2Forg-a%2Fprevious-version-before-nodes-dep.json"
_PREVIOUS = "deployments%2Forg-a%2Fprevious-version-dep.json"


@dataclass(frozen=True)
class Patch:
    id: str
    stage: Stage
    where: str  # the module that calls it
    change: str  # what the new code does that the old did not
    recorded: tuple[str, ...] = ()  # proof: histories that hold the marker
    without: tuple[str, ...] = ()  # proof: histories recorded before it (no marker)


PATCHES: tuple[Patch, ...] = (
    Patch(ORG_SCOPED_IDS, "deprecated", "control/deployment_hot_loads.py",
          "hot-load ids are scoped to the organization", recorded=(_NOW, _PREVIOUS, _BEFORE_NODES)),
    Patch(ADMISSION_CHECKS_REPLICAS, "deprecated", "control/deployment_hot_loads.py",
          "admission checks that every replica process runs", recorded=(_NOW, _PREVIOUS, _BEFORE_NODES)),
    Patch(NODE_PLACEMENT, "patched", "control/replica_set.py",
          "replicas are placed on node agents by the node registry", recorded=(_NOW,),
          without=(_PREVIOUS, _BEFORE_NODES)),
    Patch(ADMISSION_AT_ONCE, "patched", "control/deployment_hot_loads.py",
          "admission checks replicas and snapshot files at once, one round trip",
          without=(_NOW, _PREVIOUS, _BEFORE_NODES)),
    Patch(SNAPSHOTS_CHECKED_ONCE, "patched", "control/deployment_hot_loads.py",
          "admission checks only the snapshots this hot-load reads, each against its fingerprint",
          without=(_NOW, _PREVIOUS, _BEFORE_NODES)),
    Patch(OUTCOME_NOTED_ONCE, "patched", "control/deployment_hot_loads.py",
          "a hot-load's outcome sets the replicas' identities only when first noted",
          without=(_NOW, _PREVIOUS, _BEFORE_NODES)),
    Patch(PEER_JOIN, "patched", "control/autoscaler.py",
          "a joining replica starts on the base weights and takes the current snapshot from a peer",
          without=(_NOW, _PREVIOUS, _BEFORE_NODES)),
    Patch(ADMISSION_RECHECKS_NODES, "patched", "control/deployment_hot_loads.py",
          "a deployment UPDATING only for a node agent's missed check admits a hot-load once every node "
          "agent answers the admission's check; a deployment not READY after that check refuses it",
          without=(_NOW, _PREVIOUS, _BEFORE_NODES)),
)
