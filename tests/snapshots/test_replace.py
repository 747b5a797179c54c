"""snapshots/replace.py: the swap leaves `out` whole at every instant; the replaced files are
discarded (at once, or by a detached `rm`); a failed block leaves `out` as it was."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from snapshots import replace
from snapshots.replace import exchange, remove_in_background, replacing_directory


def _tree(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "f").write_text(text)
    return path


def test_exchange_swaps_two_directories(tmp_path: Path) -> None:
    a, b = _tree(tmp_path / "a", "new"), _tree(tmp_path / "b", "old")
    exchange(a, b)
    assert (b / "f").read_text() == "new" and (a / "f").read_text() == "old"


def test_exchange_without_renameat2_moves_the_old_one_aside_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class NoRenameat2:
        pass

    monkeypatch.setattr(replace, "_libc", NoRenameat2())
    a, b = _tree(tmp_path / "a", "new"), _tree(tmp_path / "b", "old")
    exchange(a, b)
    assert (b / "f").read_text() == "new" and (a / "f").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_the_replaced_files_go_to_discard_and_a_failed_block_changes_nothing(tmp_path: Path) -> None:
    out = _tree(tmp_path / "out", "old")
    discarded: list[str] = []
    with replacing_directory(out, discard=lambda p: discarded.append((p / "f").read_text())) as tmp:
        (tmp / "f").write_text("new")
    assert (out / "f").read_text() == "new" and discarded == ["old"]
    with pytest.raises(RuntimeError), replacing_directory(out, discard=lambda p: discarded.append("x")) as tmp:
        (tmp / "f").write_text("half")
        raise RuntimeError("a tensor failed")
    assert (out / "f").read_text() == "new" and discarded == ["old"]
    with replacing_directory(tmp_path / "fresh", discard=lambda p: discarded.append("y")) as tmp:
        (tmp / "f").write_text("first")
    assert (tmp_path / "fresh" / "f").read_text() == "first" and discarded == ["old"]  # nothing was replaced


def test_remove_in_background_removes_after_returning(tmp_path: Path) -> None:
    old = _tree(tmp_path / "old", "x")
    remove_in_background(old)
    deadline = time.monotonic() + 30
    while old.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not old.exists()
    assert os.listdir(tmp_path) == []
