"""Fixtures for the snapshots tests: small synthetic checkpoints, cwtrain's interpreter, a fake S3.

Everything here is a few MB at most; the realistic large generator is for bench/ only. Plain
helpers live in ``snapshot_helpers.py`` (this directory is put on ``sys.path`` for them).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from snapshot_helpers import FakeS3, copy_tree, cwtrain_python  # noqa: E402

from snapshots.synthetic import make_checkpoint_pair  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402


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

@pytest.fixture
def base_copy(pair: tuple[Path, Path], tmp_path: Path) -> Path:
    return copy_tree(pair[0], tmp_path / "base")

@pytest.fixture(scope="session")
def cw() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run a Python snippet with cwtrain's interpreter; skips when it is not installed."""
    python = cwtrain_python()
    if not python.exists():
        pytest.skip(f"cwtrain's Python 3.12 venv is absent ({python}); set ROLLOUTS_CWTRAIN_PYTHON")

    def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), "-c", code, *args], capture_output=True, text=True, timeout=300, check=False
        )

    return run

@pytest.fixture
def fake_s3(tmp_path: Path) -> FakeS3:
    (tmp_path / "s3" / "bucket").mkdir(parents=True)
    return FakeS3(tmp_path / "s3")

