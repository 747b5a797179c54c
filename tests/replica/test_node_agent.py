"""The node agent's parts that need neither Temporal nor an engine (replica/node/,
workers/commands/node.py): a replica's CUDA_VISIBLE_DEVICES, the node's capacity, its name and
address checks, the `rollouts replica` command line it starts, and `rollouts node` refusing bad
settings with a one-line error before it reaches for Temporal.

Names that must not resolve are looked up only in a network namespace with no interface up
(tests/helpers/no_network.py): no DNS traffic leaves this machine.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from common.settings import Settings
from contracts.activities import ApplySnapshotInput, StartReplicasInput
from contracts.records import HotLoadConfig, ModelSource, Placement, SnapshotRef, SnapshotType
from replica.node import activities as node_activities_module
from replica.node import capacity as node_capacity
from replica.node.activities import NodeActivities, NodeIdentity, visible_devices
from replica.node.capacity import NodeConfigError, capacity, check_name, resolve_address
from tests.helpers.no_network import python_without_network, run_without_network
from workers import cli

BAD_HOST = "no.such.host.invalid"
ENV = (
    "CUDA_VISIBLE_DEVICES",
    "ROLLOUTS_DEBUG",
    "ROLLOUTS_HOST",
    "TEMPORAL_ADDRESS",
    "ROLLOUTS_NODE_NAME",
    "ROLLOUTS_NODE_ADDRESS",
    "ROLLOUTS_NODE_ZONE",
    "ROLLOUTS_NODE_GPUS",
    "ROLLOUTS_NODE_SLOTS",
    "ROLLOUTS_ENGINE_BIND",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------- devices
def test_visible_devices_without_an_own_list_are_the_indices() -> None:
    assert visible_devices([0, 1], own="") == "0,1"
    assert visible_devices([2, 3]) == "2,3"  # no CUDA_VISIBLE_DEVICES in the agent's environment


def test_visible_devices_map_through_the_agents_own_list(monkeypatch: pytest.MonkeyPatch) -> None:
    # Slurm or a container runtime handed the agent devices 4-7: index 0 is device 4.
    assert visible_devices([0, 1], own="4,5,6,7") == "4,5"
    assert visible_devices([2, 3], own="4,5,6,7") == "6,7"
    assert visible_devices([1], own=" 4 , 5 ") == "5"
    assert visible_devices([1], own="GPU-aaaa,GPU-bbbb") == "GPU-bbbb"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert visible_devices([1]) == "7"
    assert visible_devices([1], own="") == "1"  # given explicitly: no list of its own


# --------------------------------------------------------------------------- capacity
def test_capacity_defaults_and_refusals_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_capacity, "cuda_devices", lambda: 0)
    assert capacity(None, None) == (0, 1)  # one CPU replica by default
    assert capacity(None, 3) == (0, 3)
    assert capacity(0, None) == (0, 1)
    with pytest.raises(NodeConfigError, match=r"--gpus 1: CUDA finds only 0 device\(s\)"):
        capacity(1, None)
    with pytest.raises(NodeConfigError, match="--slots 0") as err:
        capacity(0, 0)
    assert "no capacity" in str(err.value)
    with pytest.raises(NodeConfigError, match="--slots 0"):
        capacity(None, 0)
    with pytest.raises(NodeConfigError, match="--gpus must be >= 0, got -1"):
        capacity(-1, None)
    with pytest.raises(NodeConfigError, match="--slots must be >= 0, got -2"):
        capacity(None, -2)


def test_capacity_with_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_capacity, "cuda_devices", lambda: 2)
    assert capacity(None, None) == (2, 0)  # a GPU node runs no CPU replica unless told
    assert capacity(1, None) == (1, 0)
    assert capacity(2, 3) == (2, 3)
    assert capacity(0, None) == (0, 1)
    with pytest.raises(NodeConfigError, match=r"--gpus 3: CUDA finds only 2 device\(s\) on this host"):
        capacity(3, None)


def test_capacity_asks_cuda_itself() -> None:
    found = node_capacity.cuda_devices()
    assert capacity(None, 1)[0] == found
    with pytest.raises(NodeConfigError, match=f"--gpus {found + 1}: CUDA finds only {found} device"):
        capacity(found + 1, None)


# --------------------------------------------------------------------------- name and address
@pytest.mark.parametrize("name", ["n1", "gpu-node-07", "a.b_c", "X" * 63])
def test_good_node_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["a/b", "a b", "", "-lead", ".hidden", "X" * 64, "tab\there"])
def test_bad_node_names_are_refused_naming_them(name: str) -> None:
    with pytest.raises(NodeConfigError, match="node name") as err:
        check_name(name)
    assert repr(name) in str(err.value)


def test_an_ip_address_resolves_to_itself_without_a_lookup() -> None:
    assert resolve_address("127.0.0.1") == "127.0.0.1"
    assert resolve_address("10.1.2.3") == "10.1.2.3"
    assert resolve_address("::1") == "::1"


def test_a_name_that_does_not_resolve_is_refused_naming_it() -> None:
    code = (
        "from replica.node.capacity import NodeConfigError, resolve_address\n"
        f"try:\n    print('RESOLVED', resolve_address({BAD_HOST!r}))\n"
        "except NodeConfigError as exc:\n    print('REFUSED', exc)\n"
    )
    out = python_without_network(code)
    assert out.startswith("REFUSED") and f"{BAD_HOST!r} does not resolve" in out, out


# --------------------------------------------------------------------------- the replica's command line
def start_input(**kw) -> StartReplicasInput:
    return StartReplicasInput(
        deployment_id="dep-1",
        deployment_workflow_id="deployments/org-a/dep-1",
        names=["r0"],
        zone="Z1",
        model=ModelSource(name="m", bucket="rollouts", path="models/base"),
        engine_config={"max-model-len": "2048"},
        **kw,
    )


def node_activities(home: Path) -> NodeActivities:
    return NodeActivities(NodeIdentity(name="n1", address="10.1.2.3", zone="Z1", engine_bind="0.0.0.0", home=home))


def test_the_replica_command_line_names_its_node_and_parses(tmp_path: Path) -> None:
    argv = node_activities(tmp_path)._argv(start_input(), "r0")
    assert argv[:4] == [sys.executable, "-m", "workers.cli", "replica"]
    args = cli.build_parser().parse_args(argv[3:])  # what `rollouts replica` receives
    assert (args.node, args.node_address, args.engine_bind) == ("n1", "10.1.2.3", "0.0.0.0")
    assert (args.deployment, args.name, args.workflow_id, args.zone) == ("dep-1", "r0", "deployments/org-a/dep-1", "Z1")
    assert Path(args.home) == tmp_path and args.engine_config == '{"max-model-len": "2048"}'
    assert args.catch_up is None  # nothing loaded yet: the base weights


def test_the_replica_command_line_carries_the_catch_up(tmp_path: Path) -> None:
    chain = [
        SnapshotRef(identity="s1", type=SnapshotType.FULL),
        SnapshotRef(identity="s2", type=SnapshotType.INCREMENTAL),
    ]
    acts = node_activities(tmp_path)
    argv = acts._argv(
        start_input(target_chain=chain, hot_load_config=HotLoadConfig(bucket="ckpt", path_prefix="p")), "r0"
    )
    args = cli.build_parser().parse_args(argv[3:])
    catch_up = ApplySnapshotInput.model_validate_json(args.catch_up)
    assert catch_up.identity == "s2" and [link.identity for link in catch_up.chain] == ["s1", "s2"]
    assert (catch_up.bucket, catch_up.path_prefix) == ("ckpt", "p")
    assert args.node == "n1" and args.node_address == "10.1.2.3"
    # A chain without the deployment's hot-load bucket cannot be loaded: no catch-up.
    assert "--catch-up" not in acts._argv(start_input(target_chain=chain), "r0")


# --------------------------------------------------------------------------- `rollouts node`
def stack_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    Settings.create(home).save()  # its Temporal address: nothing listens there
    return home


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--address", BAD_HOST], "node address (--address)"),
        (["--address", "127.0.0.1", "--engine-bind", BAD_HOST], "engine bind address (--engine-bind)"),
    ],
)
def test_rollouts_node_refuses_an_address_that_does_not_resolve(tmp_path: Path, flags: list[str], named: str) -> None:
    home = stack_home(tmp_path)
    proc = run_without_network(
        [sys.executable, "-m", "workers.cli", "node", "--home", str(home), "--name", "n1", *flags]
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    line = one_line(proc.stderr)
    # NodeConfigError, not a connection error: the address is checked before Temporal is dialed.
    assert line.startswith(f"rollouts node: NodeConfigError: {named} {BAD_HOST!r} does not resolve"), line
    assert not (home / "run" / "node.ready").exists()


def test_rollouts_node_refuses_to_advertise_the_wildcard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    home = stack_home(tmp_path)
    assert cli.main(["node", "--home", str(home), "--name", "n1", "--address", "0.0.0.0"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("rollouts node: NodeConfigError: node address '0.0.0.0' is the wildcard"), line
    assert "--address" in line
    # Without --address the node advertises the stack's host: the wildcard there is refused too.
    monkeypatch.setenv("ROLLOUTS_HOST", "0.0.0.0")
    assert cli.main(["node", "--home", str(home), "--name", "n1"]) == 1
    assert "node address '0.0.0.0' is the wildcard" in one_line(capsys.readouterr().err)
    assert not (home / "run").exists()


def test_rollouts_node_refuses_a_bad_name_and_capacity_in_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    home = stack_home(tmp_path)
    monkeypatch.setattr(node_capacity, "cuda_devices", lambda: 0)
    base = ["node", "--home", str(home), "--address", "127.0.0.1"]  # an IP: no lookup
    assert cli.main([*base, "--name", "bad/name"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("rollouts node: NodeConfigError: node name 'bad/name'"), line
    assert cli.main([*base, "--name", "n1", "--gpus", "2"]) == 1
    line = one_line(capsys.readouterr().err)
    assert "--gpus 2: CUDA finds only 0 device(s)" in line, line
    assert cli.main([*base, "--name", "n1", "--slots", "0"]) == 1
    line = one_line(capsys.readouterr().err)
    assert "no capacity" in line and "--slots 0" in line, line
    assert not (home / "run").exists()


# --------------------------------------------------------------------------- starting replicas
def test_each_gpu_replica_gets_its_placements_devices_and_a_cpu_replica_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`start_replicas` spawns one process per replica with the placement's devices as its
    CUDA_VISIBLE_DEVICES (through the agent's own list), none for a CPU slot, and a retry starts
    nothing twice (the spawn is recorded, not run)."""
    spawned: list[tuple[str, dict]] = []

    def fake_spawn(argv, *, log_path, pid_file, env, **extra):
        spawned.append((argv[argv.index("--name") + 1], dict(env)))
        pid_file.write(os.getpid(), **extra)  # "running": this test process
        return os.getpid()

    monkeypatch.setattr(node_activities_module, "spawn", fake_spawn)
    monkeypatch.setattr(node_activities_module.activity, "logger", logging.getLogger("test"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    placements = {
        "r0": Placement(node="n1", address="10.1.2.3", devices=[0, 1]),
        "r1": Placement(node="n1", address="10.1.2.3", devices=[2, 3]),
        "r2": Placement(node="n1", address="10.1.2.3"),
    }
    inp = start_input(placements=placements).model_copy(update={"names": ["r0", "r1", "r2"]})
    acts = node_activities(tmp_path)
    assert acts.start_replicas(inp) == ["r0", "r1", "r2"]
    assert [(name, env.get("CUDA_VISIBLE_DEVICES")) for name, env in spawned] == [
        ("r0", "4,5"),
        ("r1", "6,7"),
        ("r2", None),
    ]
    assert acts.start_replicas(inp) == [] and len(spawned) == 3
