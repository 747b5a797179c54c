"""Every workflow patch of control/, with its stage and the recorded histories that prove it.

A patch (`workflow.patched(ID)`) lets deployment workflow code change while open histories keep
replaying; it goes **patched** (both branches) -> **deprecated** (`workflow.deprecate_patch`,
once `rollouts history check` says no open history lacks the marker) -> **removable**.
`PATCHES` is the table; each entry's `recorded`/`without` name the histories in tests/histories
that replay across it, and tests/control/test_patches.py checks every patch call in control/ is
listed at its stage. Workflow code imports the ids from here. Empty at 0.1.0 (CHANGELOG.md).
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
