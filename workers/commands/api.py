"""`rollouts api`: the REST API server (api/app.py) on the settings' host and API port
(``ROLLOUTS_HOST`` / ``ROLLOUTS_API_PORT`` override stack.json's); a host that does not resolve
is a one-line error naming it, before anything binds."""

from __future__ import annotations

import argparse

import uvicorn

from api.app import create_app
from common.addresses import check_bind_host
from common.settings import HOST_ENV
from workers.commands import KEEP_ALIVE_S, service_logging, settings_of


def main(args: argparse.Namespace) -> int:
    service_logging()
    settings = settings_of(args)
    host = check_bind_host(settings.host, f"the API's host ({HOST_ENV} or stack.json)")
    uvicorn.run(create_app(settings), host=host, port=settings.ports["api"], log_level="warning",
                timeout_keep_alive=KEEP_ALIVE_S)
    return 0
