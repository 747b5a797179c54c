"""`rollouts history check DIR`: the exported histories in tests/histories (a completed, a failed,
a canceled and a crash-recovered hot-load on the pairwise peer walk, a completed one on the
broadcast walk, a completed and a failed delta hot-load broadcast from the first replica's stage,
and the deployment that admitted the first three;
regenerate with
`python -m tests.histories.generate`) replay against the current workflow code, and a history
the code no longer matches is reported, naming the file."""

from __future__ import annotations

import io
import json
from pathlib import Path

from workers.cli import main as cli_main
from workers.ops import history_check

HISTORIES = Path(__file__).resolve().parent.parent / "histories"


async def test_exported_histories_replay_against_current_code():
    names = sorted(p.name for p in HISTORIES.glob("*.json"))
    assert names == ["deployments%2Fhistory-dep.json", "history-broadcast-completed.json", "history-canceled.json",
                     "history-completed.json", "history-crash-recovered.json", "history-early-completed.json",
                     "history-early-failed.json", "history-failed.json", "history-pipelined-completed.json"]
    out = io.StringIO()
    assert await history_check(HISTORIES, out=out) == 0, out.getvalue()
    assert "9/9 histories replay" in out.getvalue()


async def test_a_history_the_code_no_longer_matches_fails_with_its_name(tmp_path):
    doc = json.loads((HISTORIES / "history-completed.json").read_text())
    for event in doc["events"]:
        attrs = event.get("activityTaskScheduledEventAttributes")
        if attrs:
            attrs["activityType"]["name"] = "apply_snapshot_v0"  # what an older worker scheduled
    (tmp_path / "history-completed.json").write_text(json.dumps(doc))
    out = io.StringIO()
    assert await history_check(tmp_path, out=out) == 1
    assert "FAIL  history-completed.json" in out.getvalue()


def test_cli_history_check(capsys, tmp_path):
    assert cli_main(["history", "check", str(HISTORIES)]) == 0
    assert "9/9" in capsys.readouterr().out
    assert cli_main(["history", "check", str(tmp_path)]) == 1
    assert "no *.json histories" in capsys.readouterr().err
