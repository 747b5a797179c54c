"""`rollouts api`: the REST API server (api/app.py) on the stack's API port."""

from __future__ import annotations

import argparse

import uvicorn

from api.app import create_app
from workers.commands import service_logging, settings_of


def main(args: argparse.Namespace) -> int:
    service_logging()
    settings = settings_of(args)
    uvicorn.run(create_app(settings), host="127.0.0.1", port=settings.ports["api"], log_level="warning")
    return 0
