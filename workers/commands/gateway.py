"""`rollouts gateway`: the OpenAI-compatible gateway (gateway/app.py) on the settings' host and
gateway port (``ROLLOUTS_HOST`` / ``ROLLOUTS_GATEWAY_PORT`` override stack.json's); a host that
does not resolve is a one-line error naming it, before anything binds."""

from __future__ import annotations

import argparse

from gateway.app import create_gateway_app
from workers.commands.http_service import serve


def main(args: argparse.Namespace) -> int:
    return serve(args, create_gateway_app, "gateway", "the gateway's host")
