"""Fixtures for the snapshots tests: small synthetic checkpoints, cwtrain's interpreter, a fake S3
and a real one (SeaweedFS).

Everything here is a few MB at most; the realistic large generator is for bench/ only. Plain
helpers live in ``tests/helpers/snapshot_helpers.py``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.processes import stop_pid
from common.settings import Settings
from snapshots.synthetic import make_checkpoint_pair
from snapshots.writer import write_delta
from tests.helpers.snapshot_helpers import FakeS3, copy_tree, mutate_checkpoint
from tests.helpers.stack_fixtures import cwtrain_python, free_port_base
from workers.stack import Stack, StackError


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A ~1 MiB BF16 base checkpoint and the checkpoint one Adam step later (2 shards each)."""
    root = tmp_path_factory.mktemp("pair")
    make_checkpoint_pair(root / "base", root / "new", size_mb=1, seed=1)
    return root / "base", root / "new"


@pytest.fixture(scope="session")
def delta(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our delta from ``pair``'s base to its new checkpoint."""
    out = tmp_path_factory.mktemp("delta") / "d1"
    write_delta(pair[0], pair[1], out, version="000001", base_version="000000")
    return out


@pytest.fixture(scope="session")
def chain(
    pair: tuple[Path, Path], delta: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Path], Path]:
    """``pair``'s base, two deltas ``[delta, d2]``, and the checkpoint they reconstruct."""
    root = tmp_path_factory.mktemp("chain")
    step2 = mutate_checkpoint(pair[1], root / "step2", seed=11)
    write_delta(pair[1], step2, root / "d2", version="000002", base_version="000001")
    return pair[0], [delta, root / "d2"], step2


@pytest.fixture
def base_copy(pair: tuple[Path, Path], tmp_path: Path) -> Path:
    return copy_tree(pair[0], tmp_path / "base")


@pytest.fixture(scope="session")
def cw() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run a Python snippet with cwtrain's interpreter; skips when it is not installed."""
    python = cwtrain_python()
    if not python.exists():
        pytest.skip(f"cwtrain's Python 3.12 venv is absent ({python}); `make cwtrain` or set ROLLOUTS_CWTRAIN_PYTHON")

    def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), "-c", code, *args], capture_output=True, text=True, timeout=300, check=False
        )

    return run


@pytest.fixture
def fake_s3(tmp_path: Path) -> FakeS3:
    (tmp_path / "s3" / "bucket").mkdir(parents=True)
    return FakeS3(tmp_path / "s3")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A real SeaweedFS S3 server (``weed mini`` on 127.0.0.1 only, on free ports, its bucket
    created), started the way the stack starts it and stopped by its pid at the end."""
    for attempt in range(3):
        settings = Settings.create(tmp_path_factory.mktemp("seaweed"), free_port_base())
        stack = Stack(settings)
        try:
            stack.start("s3")
            break
        except StackError:
            # Other test sessions on this machine take ports too: a port found free may be gone
            # by the time weed binds it. Another range then.
            if attempt == 2:
                raise
    try:
        yield settings
    finally:
        pid_file = stack.pid_file("s3")
        pid = pid_file.alive_pid()
        if pid:
            stop_pid(pid, timeout=20)
        pid_file.remove()
