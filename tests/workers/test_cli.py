"""`rollouts`'s dispatch: every subcommand has a handler that imports, and the parser alone (what
`rollouts --help` runs) loads none of the heavy libraries the services use."""

from __future__ import annotations

import argparse
import subprocess
import sys

from workers.cli import COMMANDS, build_parser, handler


def test_every_subcommand_has_a_handler_that_imports():
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(COMMANDS)
    for command in COMMANDS:
        assert callable(handler(command)), command


def test_help_loads_no_service_library():
    code = (
        "import sys; from workers.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = ('temporalio', 'fastapi', 'torch', 'uvicorn', 'numpy', 'boto3', 'vllm')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
