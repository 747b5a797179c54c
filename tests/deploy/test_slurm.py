"""deploy/slurm/rollouts-nodes.sbatch, run here with stand-ins for Slurm and for `rollouts`.

``srun`` is a script that runs the one task of this machine (what Slurm runs on every allocated
node) and records its pid; ``ROLLOUTS_BIN`` is a script that records its arguments, starts a
"replica" in a session of its own with a pid file under its home (as replicas do), and waits. The
tests check what the real script does on a node: it refuses to start without the control plane's
settings or with the job's GPUs not numbered from 0, starts `rollouts node` with the node's name, address, home and
``--gpus`` from ``SLURM_GPUS_ON_NODE`` (0 when Slurm allocated none), and on SIGTERM stops the agent, stops the recorded
replica by its pid file and removes the node's scratch. Nothing reaches the network (the address is loopback's)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from common.processes import pid_alive
from tests.helpers.deploy_files import DEPLOY

SBATCH = DEPLOY / "slurm" / "rollouts-nodes.sbatch"
CONTROL_PLANE = {
    "TEMPORAL_ADDRESS": "127.0.0.1:7233",
    "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000",
    "AWS_ACCESS_KEY_ID": "k",
    "AWS_SECRET_ACCESS_KEY": "s",
    "ROLLOUTS_ENGINE_KEY": "e",
    "ROLLOUTS_DYNAMO_DISCOVERY_DIR": "/shared/dynamo/discovery",
}

FAKE_SRUN = """#!/bin/bash
# Slurm's srun, for one node: run the task here, in the foreground.
echo $$ > "$FAKE_DIR/task.pid"
shift
exec "$@"
"""
FAKE_ROLLOUTS = """#!/bin/bash
# `rollouts node`: record the arguments, start a replica in its own session with a pid file, wait.
echo "$@" > "$FAKE_DIR/args"
home="$ROLLOUTS_HOME"
setsid sleep 300 &
replica=$!
start="$(sed 's/.*) //' /proc/$replica/stat | awk '{print $20}')"
mkdir -p "$home/replicas/dep/r0"
echo "{\\"pid\\": $replica, \\"start\\": \\"$start\\"}" > "$home/replicas/dep/r0/replica.pid"
echo "$replica" > "$FAKE_DIR/replica"
trap 'echo terminated > "$FAKE_DIR/agent-exit"; kill $waiter; exit 0' TERM
sleep 300 &
waiter=$!
wait $waiter
"""


def _wait_for(condition, what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("rollouts", FAKE_ROLLOUTS)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "scratch").mkdir()
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_DIR": str(tmp_path),
        "ROLLOUTS_BIN": str(bin_dir / "rollouts"),
        "NODE_IFACE": "lo",
        "NODE_SCRATCH": str(tmp_path / "scratch"),
        "SLURM_JOB_ID": "4242",
    }


@pytest.mark.parametrize("missing", ["ROLLOUTS_ENGINE_KEY", "ROLLOUTS_DYNAMO_DISCOVERY_DIR"])
def test_it_refuses_to_start_without_the_control_plane_settings(fake, missing):
    env = {**fake, **CONTROL_PLANE}
    del env[missing]
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"{missing} is not set" in done.stderr
    assert not (Path(fake["FAKE_DIR"]) / "args").exists()


def test_gpus_numbered_other_than_from_zero_are_refused(fake):
    # The agent hands replicas device numbers counted from 0: physical numbers would be other jobs' GPUs.
    env = {**fake, **CONTROL_PLANE, "SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "4,5"}
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "CUDA_VISIBLE_DEVICES=4,5 is not 0..1" in done.stderr and "ConstrainDevices=yes" in done.stderr
    assert not (Path(fake["FAKE_DIR"]) / "args").exists()


@pytest.mark.parametrize(
    ("allocated", "gpus"),
    [({"SLURM_GPUS_ON_NODE": "2"}, "2"), ({"SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, "2"), ({}, "0")],
)
def test_one_agent_per_node_with_its_gpus_and_a_clean_stop(fake, allocated, gpus):
    # Without allocated GPUs the agent is told 0, so it never takes a GPU outside the job.
    fake_dir = Path(fake["FAKE_DIR"])
    job = subprocess.Popen(
        ["bash", str(SBATCH)],
        env={**fake, **CONTROL_PLANE, **allocated},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(lambda: (fake_dir / "replica").exists() and (fake_dir / "task.pid").exists(), "the agent to start")
        host = socket.gethostname().split(".")[0]
        scratch = Path(fake["NODE_SCRATCH"]) / f"rollouts-4242-{host}"
        assert (fake_dir / "args").read_text().split() == [
            "node",
            "--name",
            host,
            "--address",
            "127.0.0.1",
            "--home",
            str(scratch),
            "--gpus",
            gpus,
        ]
        replica = int((fake_dir / "replica").read_text())
        assert pid_alive(replica) and scratch.is_dir()  # the premise: there is something to clean up

        os.kill(int((fake_dir / "task.pid").read_text()), signal.SIGTERM)  # Slurm's TERM to the step
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert (fake_dir / "agent-exit").read_text().strip() == "terminated", output
    _wait_for(lambda: not pid_alive(replica), "the replica to be stopped")
    assert not scratch.exists()
