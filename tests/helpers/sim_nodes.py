"""SIMULATED node agents (``rollouts sim-node``, replica/simulated/: no engine) for the benches that
drive many replicas on the real stack (bench/scale.py, bench/chain_length.py): started in the
stack's own environment (``Settings.process_env``: a sourced stack.env of another stack does not
redirect them), each logging to ``HOME/logs/<name>.log``, and stopped (SIGTERM, then SIGKILL
after 30 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def start_sim_node(
    settings: Settings, name: str, gpus: int, *extra: str, nice: int | None = None
) -> subprocess.Popen[bytes]:
    log = open(settings.home_path / "logs" / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
    prefix = ["nice", "-n", str(nice)] if nice is not None else []
    return subprocess.Popen(
        [
            *prefix,
            sys.executable,
            "-m",
            "workers.cli",
            "sim-node",
            "--home",
            str(settings.home_path),
            "--name",
            name,
            "--gpus",
            str(gpus),
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=settings.process_env(),
    )


def stop_sim_nodes(nodes: list[subprocess.Popen[bytes]]) -> None:
    for p in nodes:
        p.terminate()
    for p in nodes:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
