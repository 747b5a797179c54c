"""One HTTP service process (`rollouts api`, `rollouts gateway`): its app on the settings' host
and its own port of the stack's; a host that does not resolve is a one-line error naming it,
before anything binds."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import uvicorn

from common.addresses import check_bind_host
from common.settings import HOST_ENV, Settings
from workers.commands import KEEP_ALIVE_S, service_logging, settings_of


def serve(args: argparse.Namespace, make_app: Callable[[Settings], Any], port: str, what: str) -> int:
    """Serve ``make_app(settings)`` on ``settings.ports[port]``; ``what`` names the host in an error."""
    service_logging()
    settings = settings_of(args)
    host = check_bind_host(settings.host, f"{what} ({HOST_ENV} or stack.json)")
    uvicorn.run(
        make_app(settings), host=host, port=settings.ports[port], log_level="warning", timeout_keep_alive=KEEP_ALIVE_S
    )
    return 0
