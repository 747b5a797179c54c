"""`rollouts gateway`: the OpenAI-compatible gateway (gateway/app.py) on the stack's gateway port."""

from __future__ import annotations

import argparse

import uvicorn

from gateway.app import create_gateway_app
from workers.commands import service_logging, settings_of


def main(args: argparse.Namespace) -> int:
    service_logging()
    settings = settings_of(args)
    uvicorn.run(create_gateway_app(settings), host="127.0.0.1", port=settings.ports["gateway"], log_level="warning")
    return 0
