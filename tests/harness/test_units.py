"""How the suite's tests are grouped into scheduling units for pytest-xdist's workers
(tests/helpers/parallel.py): a module starting the stack runs whole on one worker, unless it is
marked ``unit_per_test``; unit tests and per-test modules spread over the workers."""

from __future__ import annotations

import json

from tests.helpers.parallel import EACH_TEST, UNITS_ENV, UnitScheduling, unit_of, unit_rank

POOLS = ("rolling", "gw")


def test_a_heavy_module_is_one_unit_unless_it_asks_for_one_per_test():
    assert unit_of("tests/e2e/a.py", frozenset(), False, True, POOLS) == "tests/e2e/a.py"
    assert unit_of("tests/e2e/a.py", frozenset(), False, True, POOLS, per_test=True) == EACH_TEST + "tests/e2e/a.py"
    assert unit_of("tests/unit/b.py", frozenset(), False, False, POOLS, per_test=True) == ""
    assert unit_of("tests/e2e/c.py", frozenset({"gw", "rolling"}), False, True, POOLS, per_test=True) == "pool:rolling"
    assert unit_of("tests/multihost/d.py", frozenset(), True, True, POOLS, per_test=True) == "multihost"


def test_per_test_units_run_among_the_heavy_ones_and_each_test_is_a_scope(tmp_path, monkeypatch):
    assert [unit_rank(u) for u in ("multihost", "pool:gw", "tests/e2e/a.py", EACH_TEST + "tests/e2e/f.py", "")] == [
        0,
        1,
        2,
        2,
        3,
    ]
    units = tmp_path / "units.json"
    units.write_text(
        json.dumps(
            {"tests/e2e/a.py": "tests/e2e/a.py", "tests/e2e/f.py": EACH_TEST + "tests/e2e/f.py", "tests/u.py": ""}
        )
    )
    monkeypatch.setenv(UNITS_ENV, str(units))
    split = UnitScheduling.__new__(UnitScheduling)._split_scope
    assert split("tests/e2e/a.py::test_x") == split("tests/e2e/a.py::test_y") == "tests/e2e/a.py"
    assert split("tests/e2e/f.py::test_x[llama-tp1]") == "tests/e2e/f.py::test_x[llama-tp1]"
    assert split("tests/u.py::test_z") == "tests/u.py::test_z"
