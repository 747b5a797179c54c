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

`PATCHES` is the table; each patch's `recorded`/`without` name the histories in tests/histories
that replay across it (tests/ops/test_history_check.py replays them; tests/control/test_patches.py
checks that every patch call in control/ is listed here at its stage, and that each proof history
exists and holds or lacks the marker as its stage says). Workflow code imports the ids from
here. The table is empty at 0.1.0 (CHANGELOG.md): the first change to workflow code after a
release that running histories could not replay adds its patch here, with a history recorded
before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Stage = Literal["patched", "deprecated", "removable"]

# The ids, as workflow code passes them to workflow.patched / workflow.deprecate_patch (none
# since 0.1.0, CHANGELOG.md: histories from before it are not replayed).


@dataclass(frozen=True)
class Patch:
    id: str
    stage: Stage
    where: str  # the module that calls it
    change: str  # what the new code does that the old did not
    recorded: tuple[str, ...] = ()  # proof: histories that hold the marker
    without: tuple[str, ...] = ()  # proof: histories recorded before it (no marker)


PATCHES: tuple[Patch, ...] = ()
