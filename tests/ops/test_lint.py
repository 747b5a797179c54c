"""`make lint`'s import contracts (pyproject.toml, run by import-linter) hold on this tree and
catch what they state: an import cycle inside a package, and an import against the layering
(entry points -> api | gateway | control | replica -> contracts -> snapshots | common). Each bad
case runs on a copy of the packages with one import added. Every folder of a package has an
__init__.py. And no test module imports another test module or a conftest: what tests share
lives in tests/helpers/."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    # The copy comes first on the path (the editable install's finder only answers after it).
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The project's packages and pyproject.toml, copied."""
    for package in CONFIG["root_packages"]:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_tree_keeps_every_contract():
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BROKEN" not in proc.stdout and "0 broken" in proc.stdout, proc.stdout


def test_the_copy_keeps_every_contract(copy: Path):
    proc = lint_imports(copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_cycle_inside_a_package_fails(copy: Path):
    # snapshots.chain imports snapshots.identity; the way back closes a cycle.
    assert "from snapshots.identity import" in (copy / "snapshots" / "chain.py").read_text()
    add_import(copy / "snapshots" / "identity.py", "import snapshots.chain  # noqa")
    proc = lint_imports(copy)
    assert proc.returncode != 0, proc.stdout
    assert "No import cycles between the modules of any package BROKEN" in proc.stdout, proc.stdout
    assert "No cycles are allowed in snapshots" in proc.stdout, proc.stdout
    assert ".identity -> .chain" in proc.stdout or ".chain -> .identity" in proc.stdout, proc.stdout


def test_a_lower_layer_importing_a_higher_one_fails(copy: Path):
    add_import(copy / "common" / "ids.py", "import api.app  # noqa")
    proc = lint_imports(copy)
    assert proc.returncode != 0, proc.stdout
    assert "Layers: entry points" in proc.stdout and "BROKEN" in proc.stdout, proc.stdout
    assert "common.ids -> api.app" in proc.stdout, proc.stdout


def test_siblings_of_one_layer_stay_apart(copy: Path):
    add_import(copy / "gateway" / "errors.py", "import api.models  # noqa")
    proc = lint_imports(copy)
    assert proc.returncode != 0, proc.stdout
    assert "gateway.errors -> api.models" in proc.stdout, proc.stdout


def test_the_client_imports_nothing_of_the_service(copy: Path):
    add_import(copy / "rollouts" / "client.py", "import common.ids  # noqa")
    proc = lint_imports(copy)
    assert proc.returncode != 0, proc.stdout
    assert "rollouts.client -> common.ids" in proc.stdout, proc.stdout


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom):  # relative: a test folder is no package
            names.add("." * node.level + (node.module or ""))
    return names


def test_no_test_imports_another_test_module_or_a_conftest():
    offences = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for name in sorted(_imported_modules(path)):
            last = name.rsplit(".", 1)[-1]
            if name.startswith(".") or (
                name.split(".")[0] in ("tests", "conftest") and (last == "conftest" or last.startswith("test_"))
            ):
                offences.append(f"{path.relative_to(REPO)} imports {name}")
    assert not offences, "what tests share belongs in tests/helpers/:\n" + "\n".join(offences)


def test_every_package_folder_is_a_regular_package():
    # A folder without __init__.py is a namespace package: setuptools' find leaves it out of the
    # wheel, and import-linter may read another copy of it on the path.
    missing = [
        str(folder.relative_to(REPO))
        for package in CONFIG["root_packages"]
        for folder in [REPO / package, *(REPO / package).rglob("*")]
        if folder.is_dir()
        and folder.name != "__pycache__"
        and any(folder.glob("*.py"))
        and not (folder / "__init__.py").exists()
    ]
    assert not missing, f"folders without __init__.py: {missing}"
