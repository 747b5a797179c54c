"""The shared deployments of the suite (e2e's 3-replica ``rolling``, the gateway's 2-replica
``gw``), one alive at a time, so that a full run never holds more than three vLLM engines.

``POOL.get(key, replicas, create, delete)`` returns the live deployment of ``key``, or deletes the
live one of another key (``delete`` waits until the API no longer knows it, then the pool until
its engines exited) and creates this one once the engines have room. tests/conftest.py orders each folder's modules so
that the users of one key run together, releases the pool before a module that starts engines without using it, and
before the stack stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.helpers.engines import MAX_ENGINES, engines, wait_engines_at_most
from tests.helpers.stack_fixtures import Api

# The fixtures whose deployments live in the pool (tests/e2e/conftest.py, tests/gateway/conftest.py).
POOLED_FIXTURES = ("rolling", "gw", "vllm_gw")


class DeploymentPool:
    def __init__(self) -> None:
        self.key: str | None = None
        self.value: Any = None
        self.replicas = 0
        self._delete: Callable[[Any], None] | None = None
        self.created: list[str] = []  # keys in creation order (a key twice: tests of it were not together)

    def get(self, key: str, replicas: int, create: Callable[[], Any], delete: Callable[[Any], None]) -> Any:
        if self.key == key:
            return self.value
        self.release()
        wait_engines_at_most(MAX_ENGINES - replicas)
        self.value = create()
        self.key, self._delete, self.replicas = key, delete, replicas
        self.created.append(key)
        return self.value

    def release(self) -> None:
        if self.key is None:
            return
        value, delete, replicas = self.value, self._delete, self.replicas
        self.key, self.value, self._delete, self.replicas = None, None, None, 0
        assert delete is not None
        before = len(engines())
        delete(value)
        # Its replicas' engines exit a moment after the API forgets the deployment.
        wait_engines_at_most(max(0, before - replicas))


POOL = DeploymentPool()


def delete_deployment(api: Api, dep_id: str, timeout: float = 300) -> None:
    """DELETE a deployment and wait until the API no longer knows it (its replicas are stopped)."""
    r = api.call("DELETE", f"/deployments/{dep_id}")
    assert r.status_code in (200, 404), r.text
    deadline = time.monotonic() + timeout
    while api.call("GET", f"/deployments/{dep_id}").status_code != 404:
        assert time.monotonic() < deadline, f"deployment {dep_id} not deleted after {timeout:.0f}s"
        time.sleep(0.5)
