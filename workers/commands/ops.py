"""`rollouts replay | rollback | hotload wait | history check`: operator commands (workers/ops.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from workers.ops import OpsError, history_check, replay, rollback, run, wait_and_report


def replay_command(args: argparse.Namespace) -> int:
    return run(lambda http: replay(http, args.hot_load_id, out=sys.stdout, poll_s=args.poll), args.home)


def rollback_command(args: argparse.Namespace) -> int:
    return run(lambda http: rollback(http, args.identity, args.deployment, out=sys.stdout, poll_s=args.poll), args.home)


def hotload_wait(args: argparse.Namespace) -> int:
    return run(lambda http: wait_and_report(http, args.hot_load_id, out=sys.stdout, poll_s=args.poll), args.home)


def history_check_command(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(history_check(Path(args.directory), out=sys.stdout))
    except OpsError as exc:
        print(f"rollouts: {exc}", file=sys.stderr)
        return 1
