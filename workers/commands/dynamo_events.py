"""`rollouts dynamo-events`: the relay of Dynamo's event plane (gateway/dynamo_events.py) on the
settings' host and its ``dynamo_events_in`` / ``dynamo_events_out`` ports; `rollouts up` starts
it before Dynamo's frontend. A host that does not resolve is a one-line error naming it, before
anything binds."""

from __future__ import annotations

import argparse

from common.addresses import check_bind_host
from common.settings import HOST_ENV
from gateway.dynamo_events import serve
from workers.commands import service_logging, settings_of


def main(args: argparse.Namespace) -> int:
    service_logging()
    settings = settings_of(args)
    host = check_bind_host(settings.host, f"the Dynamo event relay's host ({HOST_ENV} or stack.json)")
    serve(host, settings.ports["dynamo_events_in"], settings.ports["dynamo_events_out"])
    return 0
