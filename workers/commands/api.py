"""`rollouts api`: the REST API server (api/app.py) on the settings' host and API port
(``ROLLOUTS_HOST`` / ``ROLLOUTS_API_PORT`` override stack.json's); a host that does not resolve
is a one-line error naming it, before anything binds."""

from __future__ import annotations

import argparse

from api.app import create_app
from workers.commands.http_service import serve


def main(args: argparse.Namespace) -> int:
    return serve(args, create_app, "api", "the API's host")
