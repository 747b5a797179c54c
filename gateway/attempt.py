"""One inference request's bookkeeping, shared by the vLLM path (``gateway/proxy.py``), the Dynamo
path (``gateway/dynamo_proxy.py``) and the answer side (``gateway/relay.py``).

- ``Attempt(plan, view)``: the request's plan and the deployment view read before it was sent
  (the "before" of ``nvext.weight_versions``), the gateway clock when it was received (wall and
  monotonic), and its token events (``saw_tokens(now)``: first, last, count) for
  ``nvext.timing``.
- ``Served(replica, url)``: who serves a relayed stream (for a Dynamo deployment it may change to
  the worker Dynamo's frontend names) and the URL whose in-flight count the stream holds.
- ``SESSION_HEADER``: the request header that pins a trajectory (``X-Dynamo-Session-ID``);
  ``REPLICA_HEADER``: the answer header naming the replica that served it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.nvext import RequestPlan
from gateway.routing import DeploymentView, ReplicaView

SESSION_HEADER = "x-dynamo-session-id"
REPLICA_HEADER = "x-rollouts-replica"


@dataclass
class Attempt:
    """One request's bookkeeping across its tries."""

    plan: RequestPlan
    view: DeploymentView  # read before the request was sent (the "before" of weight_versions)
    received_wall: float = field(default_factory=time.time)
    received: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    token_events: int = 0

    def saw_tokens(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.token_events += 1


@dataclass
class Served:
    """Who is serving a relayed stream: the replica (known from the start for a vLLM replica; for a
    dynamo deployment, once Dynamo's frontend names its worker) and the URL whose load it counts."""

    replica: ReplicaView
    url: str
