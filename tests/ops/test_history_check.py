"""`rollouts history check DIR`: the exported histories in tests/histories (hot-loads that
completed with the broadcast after the first commit and with the early offer, failed, were
canceled and crash-recovered; the deployment that admitted the first four, placing its replicas
on a node; regenerate with `python -m tests.histories.generate`) replay against the current
workflow code,
and a history the code no longer matches is reported, naming the file."""

from __future__ import annotations

import io
import json
from pathlib import Path

from workers.cli import main as cli_main
from workers.ops import history_check

HISTORIES = Path(__file__).resolve().parent.parent / "histories"
COMPLETED = "hotLoads%2Forg-a%2Fhistory-completed.json"


async def test_exported_histories_replay_against_current_code():
    names = sorted(p.name for p in HISTORIES.glob("*.json"))
    assert names == [
        "deployments%2Forg-a%2Fhistory-dep.json",
        "hotLoads%2Forg-a%2Fhistory-canceled.json",
        COMPLETED,
        "hotLoads%2Forg-a%2Fhistory-crash-recovered.json",
        "hotLoads%2Forg-a%2Fhistory-early-completed.json",
        "hotLoads%2Forg-a%2Fhistory-failed.json",
    ]
    out = io.StringIO()
    assert await history_check(HISTORIES, out=out) == 0, out.getvalue()
    assert "6/6 histories replay" in out.getvalue()


async def test_a_history_the_code_no_longer_matches_fails_with_its_name(tmp_path):
    doc = json.loads((HISTORIES / COMPLETED).read_text())
    for event in doc["events"]:
        attrs = event.get("activityTaskScheduledEventAttributes")
        if attrs:
            attrs["activityType"]["name"] = "apply_snapshot_v0"  # what an older worker scheduled
    (tmp_path / COMPLETED).write_text(json.dumps(doc))
    out = io.StringIO()
    assert await history_check(tmp_path, out=out) == 1
    assert f"FAIL  {COMPLETED}" in out.getvalue()


def test_cli_history_check(capsys, tmp_path):
    assert cli_main(["history", "check", str(HISTORIES)]) == 0
    assert "6/6" in capsys.readouterr().out
    assert cli_main(["history", "check", str(tmp_path)]) == 1
    assert "no *.json histories" in capsys.readouterr().err
