"""`rollouts gateway`: the OpenAI-compatible gateway (gateway/app.py) on the settings' host and
gateway port (``ROLLOUTS_HOST`` / ``ROLLOUTS_GATEWAY_PORT`` override stack.json's); a host that
does not resolve is a one-line error naming it, before anything binds."""

from __future__ import annotations

import argparse

import uvicorn

from common.addresses import check_bind_host
from common.settings import HOST_ENV
from gateway.app import create_gateway_app
from workers.commands import KEEP_ALIVE_S, service_logging, settings_of


def main(args: argparse.Namespace) -> int:
    service_logging()
    settings = settings_of(args)
    host = check_bind_host(settings.host, f"the gateway's host ({HOST_ENV} or stack.json)")
    uvicorn.run(create_gateway_app(settings), host=host, port=settings.ports["gateway"], log_level="warning",
                timeout_keep_alive=KEEP_ALIVE_S)
    return 0
