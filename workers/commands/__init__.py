"""The handlers of `rollouts` subcommands (workers/cli.py), one module per command or group: a
command imports only what its process runs, so `rollouts --help` or `rollouts status` load
neither Temporal, FastAPI, torch nor the replica's engine client. Each handler takes the parsed
arguments (``args.home`` already resolved) and returns the exit status."""

from __future__ import annotations

import argparse
import logging

from common.settings import Settings


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings.load(args.home)


def service_logging(verbose: bool = False) -> None:
    """Log lines for a service process (api, worker, gateway, replica)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per engine call is noise in the replica and gateway logs.
    logging.getLogger("httpx").setLevel(logging.WARNING)
