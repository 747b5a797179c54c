"""`rollouts snapshot ...`: the checkpoint tools of snapshots/cli.py."""

from __future__ import annotations

import argparse

from snapshots.cli import main as snapshot_main


def main(args: argparse.Namespace) -> int:
    return snapshot_main(args.rest)
