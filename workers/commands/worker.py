"""`rollouts worker`: the control-plane worker (workers/control_worker.py)."""

from __future__ import annotations

import argparse
import asyncio

from workers.commands import service_logging, settings_of
from workers.control_worker import run_control_worker


def main(args: argparse.Namespace) -> int:
    service_logging()
    asyncio.run(run_control_worker(settings_of(args)))
    return 0
