"""control/patches.py is the truth about the workflow patches: every `workflow.patched` /
`workflow.deprecate_patch` call in control/ names a listed patch at the stage its call says, no
listed patch is missing from the code unless it is removable, and each proof names a history in
tests/histories that holds the marker (``recorded``) or lacks it (``without``), as recorded.
(tests/ops/test_history_check.py replays those histories against the code.)"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from control import patches

REPO = Path(__file__).resolve().parents[2]
HISTORIES = REPO / "tests" / "histories"
CALL = re.compile(r"workflow\.(patched|deprecate_patch)\(([A-Z_]+)\)")


def _calls(root: Path = REPO / "control") -> dict[str, set[str]]:
    """patch id -> the kinds of call the workflow code under `root` makes with it."""
    ids = {
        name: getattr(patches, name)
        for name in dir(patches)
        if name.isupper() and isinstance(getattr(patches, name), str)
    }
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        if path.name == "patches.py":
            continue
        for kind, name in CALL.findall(path.read_text()):
            assert name in ids, f"{path.relative_to(root)}: workflow.{kind}({name}) names no id of control/patches.py"
            found.setdefault(ids[name], set()).add(kind)
    return found


def _markers(history: str) -> set[str]:
    events = json.loads((HISTORIES / history).read_text())["events"]
    out = set()
    for e in events:
        marker = e.get("markerRecordedEventAttributes")
        if marker and marker.get("markerName") == "core_patch":
            for p in marker["details"]["patch-data"]["payloads"]:
                out.add(json.loads(base64.b64decode(p["data"]))["id"])
    return out


def test_every_patch_call_is_listed_at_its_stage():
    calls = _calls()
    listed = {p.id: p for p in patches.PATCHES}
    assert len(listed) == len(patches.PATCHES), "a patch id is listed twice"
    assert set(calls) <= set(listed), set(calls) - set(listed)
    for patch in patches.PATCHES:
        expected = {"patched": {"patched"}, "deprecated": {"deprecate_patch"}, "removable": set()}[patch.stage]
        assert calls.get(patch.id, set()) == expected, (patch.id, patch.stage, calls.get(patch.id))
        if patch.stage != "removable":  # `where` is the module that makes the call
            names = [n for n in dir(patches) if n.isupper() and getattr(patches, n) == patch.id]
            assert any(
                CALL.search(line) and n in line for n in names for line in (REPO / patch.where).read_text().splitlines()
            ), (patch.id, patch.where)


def test_a_patch_call_not_in_the_table_is_found(tmp_path):
    """The premise of the check above, with an empty table: a call it does not list fails it."""
    (tmp_path / "wf.py").write_text("if workflow.patched(NEW_BRANCH):\n    pass\n")
    with pytest.raises(AssertionError, match=r"wf.py: workflow.patched\(NEW_BRANCH\) names no id"):
        _calls(tmp_path)


def test_each_proof_history_holds_or_lacks_the_marker_as_listed():
    for patch in patches.PATCHES:
        assert patch.recorded or patch.without, f"{patch.id}: no history proves it"
        for history in patch.recorded:
            assert patch.id in _markers(history), f"{history} does not record {patch.id}"
        for history in patch.without:
            assert patch.id not in _markers(history), f"{history} records {patch.id}"
