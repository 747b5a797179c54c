"""Fixtures for multi-host tests (tests/multihost/hosts.py).

- ``cluster``: three hosts for the whole module, torn down after its last test.
- ``make_cluster(count=3, shm_bytes=...)``: a new, not yet entered ``Cluster`` (use it as ``with``);
  any left open is closed when the test ends.

Both skip the test when the machine cannot make hosts (not root, or ``ip``/``unshare``/``nsenter``
missing), with the reason; with ``ROLLOUTS_REQUIRE_MULTIHOST=1`` in the environment they fail instead.
tests/conftest.py marks every test using either ``multihost``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from tests.multihost.hosts import DEFAULT_SHM_BYTES, Cluster, unavailable_reason

REQUIRE_ENV = "ROLLOUTS_REQUIRE_MULTIHOST"


def require_hosts() -> None:
    """Skip (or fail, with ROLLOUTS_REQUIRE_MULTIHOST=1) when this machine cannot make hosts."""
    if reason := unavailable_reason():
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_hosts()
    with Cluster(3, base_dir=tmp_path_factory.mktemp("multihost")) as made:
        yield made


@pytest.fixture
def make_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Cluster]]:
    require_hosts()
    made: list[Cluster] = []

    def make(count: int = 3, shm_bytes: int = DEFAULT_SHM_BYTES) -> Cluster:
        made.append(Cluster(count, shm_bytes, base_dir=tmp_path_factory.mktemp("multihost")))
        return made[-1]

    yield make
    errors = []
    for each in reversed(made):
        try:
            each.close()
        except Exception as exc:  # close the others first
            errors.append(exc)
    if errors:
        raise errors[0]
