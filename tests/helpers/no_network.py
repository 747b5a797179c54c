"""Run a command in a network namespace of its own with no interface up: a name it looks up
fails at once (no DNS server is reachable) and nothing it sends leaves the namespace, which
the kernel removes when the command exits. For tests of addresses that must not resolve
(``no.such.host.invalid``) without asking this machine's DNS server. Needs root and
``unshare`` (CI runs as root); otherwise the test is skipped with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def run_without_network(
    argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare to look up a name with no network (no DNS traffic)")
    return subprocess.run(
        [unshare, "--net", "--", *argv],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def python_without_network(code: str) -> str:
    """What ``python -c code`` prints with no network; it must exit 0 (its stderr is the message)."""
    proc = run_without_network([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
