"""`rollouts`: the command line of the service.

    rollouts up | down | status        the embedded stack, on 127.0.0.1 or `up --host ADDR` (`make up` / `make down`)
    rollouts demo [--steps N ...]      up, a 2-replica deployment, a tiny GRPO loop that learns
                                       through delta hot-loads, a plot and a table, down
    rollouts api | worker | gateway    one service process (what `up` starts)
    rollouts dynamo-frontend           NVIDIA Dynamo's frontend, for a cluster install
    rollouts dynamo-events             the relay of Dynamo's event plane (`up` starts it)
    rollouts node [--name N --address A --slots N | --gpus N]   a node agent: runs replicas here
    rollouts nodes [NAME]              the node agents the control plane knows, and their replicas
    rollouts sim-node --name N --gpus K    a SIMULATED node agent (scale runs: bench/scale.py)
    rollouts replica ...               one replica (started by its node agent)
    rollouts snapshot ...              inspect / delta / apply / verify checkpoints (snapshots/)
    rollouts token add ...             add an API token to the tokens file
    rollouts replay HOT_LOAD_ID        a new hot-load of the same snapshot, waited for (workers/ops.py)
    rollouts rollback IDENTITY --deployment D    re-serve an earlier completed snapshot
    rollouts hotload wait HOT_LOAD_ID  print progress until the operation ends
    rollouts history check DIR         replay exported workflow histories against this code

Every command exits non-zero with a one-line reason on failure. This module is the parser and
the dispatch only: each command's handler is in workers/commands/ and is imported when that
command runs (`COMMANDS`), so `rollouts --help` imports none of Temporal, FastAPI, torch or the
replica's engine client (its start-up time is in bench/README.md).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from common import envs
from common.settings import home_from_env
from contracts import names

# Each command's handler, "module:function" (workers/commands/), imported only when the command
# runs: every process the stack starts and every operator command loads what it runs and no more.
COMMANDS: dict[str, str] = {
    "up": "workers.commands.stack:up",
    "down": "workers.commands.stack:down",
    "status": "workers.commands.stack:status",
    "api": "workers.commands.api:main",
    "worker": "workers.commands.worker:main",
    "gateway": "workers.commands.gateway:main",
    "dynamo-frontend": "workers.commands.dynamo:main",
    "dynamo-events": "workers.commands.dynamo_events:main",
    "replica": "workers.commands.replica:main",
    "node": "workers.commands.node:main",
    "nodes": "workers.commands.node:list_nodes",
    "sim-node": "workers.commands.sim_node:main",
    "snapshot": "workers.commands.snapshot:main",
    "demo": "workers.commands.demo:main",
    "token": "workers.commands.stack:token_add",
    "replay": "workers.commands.ops:replay_command",
    "rollback": "workers.commands.ops:rollback_command",
    "hotload": "workers.commands.ops:hotload_wait",
    "history": "workers.commands.ops:history_check_command",
}


# Commands that use numpy but never its BLAS: one OpenBLAS thread, not one per core spinning at
# start-up and taking CPU from the command's own workers (~7 % of `snapshot apply`'s CPU here).
NO_BLAS_THREADS = {"snapshot"}


def handler(command: str):
    if command in NO_BLAS_THREADS:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    module, function = COMMANDS[command].split(":")
    return getattr(importlib.import_module(module), function)


def _env_int(var: envs.Var[int | None]) -> int | None:
    try:
        return var.get()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


_Add = Callable[[str, str], argparse.ArgumentParser]


def _stack_commands(add: _Add) -> None:
    """The stack and its services: up, down, status, api, worker, gateway, Dynamo's frontend and events."""
    p = add("up", "start the embedded stack")
    p.add_argument(
        "--node-slots",
        type=int,
        default=None,
        metavar="N",
        help="replicas the stack's own node agent runs (default 8; 0: no node agent here, replicas "
        "run on node agents started elsewhere with `rollouts node`)",
    )
    p.add_argument("--port-base", type=int, default=None, help="first port of the stack's range (default 17200)")
    p.add_argument(
        "--host",
        default=None,
        metavar="ADDR",
        help="IP address the stack's services bind and advertise (default $ROLLOUTS_HOST, else the "
        "home's recorded one, else 127.0.0.1)",
    )
    p.add_argument(
        "--dynamo-router-mode",
        choices=("least-loaded", "kv"),
        default=None,
        help="Dynamo's router for dynamo-vllm replicas: least-loaded (default) or kv (by prefix-cache "
        "overlap; recorded in the home: later `up`s keep it)",
    )
    add("down", "stop everything the stack started")
    add("status", "what runs")
    add("api", "run the API server")
    add("worker", "run the control-plane worker")
    add("gateway", "run the gateway")
    p = add("dynamo-frontend", "run NVIDIA Dynamo's frontend (a cluster install; `up` starts its own)")
    p.add_argument(
        "--port",
        type=int,
        default=_env_int(envs.ROLLOUTS_DYNAMO_PORT),
        help="HTTP port (default $ROLLOUTS_DYNAMO_PORT, else the stack's port base + 2)",
    )
    p.add_argument(
        "--address",
        default=envs.ROLLOUTS_DYNAMO_ADDRESS.get(),
        metavar="ADDR",
        help="this host's address, where workers send answers back (default $ROLLOUTS_DYNAMO_ADDRESS, "
        "else the settings' host)",
    )
    add("dynamo-events", "run the relay of Dynamo's event plane (`up` starts it)")


def _replica_commands(add: _Add) -> None:
    """Replicas and the node agents that run them: replica, sim-node, node, nodes."""
    p = add("replica", "run one replica (engine + agent)")
    for flag in ("--deployment", "--name", "--workflow-id", "--zone", "--model-bucket", "--model-path", "--model-name"):
        p.add_argument(flag, required=True)
    p.add_argument(
        "--engine",
        choices=names.ENGINES,
        default=names.HOT_LOAD_ENGINE,
        help="runtime.engine: dynamo-vllm (Dynamo's vLLM worker) or vllm (vLLM's OpenAI server)",
    )
    p.add_argument("--engine-config", default="{}", help="JSON runtime.engineConfig: vLLM flags")
    p.add_argument("--catch-up", default=None, help="JSON ApplySnapshotInput to load before reporting ready")
    p.add_argument(
        "--joining",
        action="store_true",
        help="a scale-out's new replica: out of the engine's routing pool until the deployment serves it",
    )
    p.add_argument(
        "--node-address",
        default=None,
        metavar="ADDR",
        help="address other hosts reach this replica at: its engine URL and peer broadcast "
        "(default: the settings' host)",
    )
    p.add_argument(
        "--engine-bind",
        default=None,
        metavar="ADDR",
        help="address the engine binds (default: the node address; 0.0.0.0 for every address)",
    )
    p.add_argument("--node", default="", help="the node agent that started it (reported to its deployment)")
    p = add(
        "sim-node", "run a SIMULATED node agent: many simulated replicas (no engine) in one process, for scale runs"
    )
    p.add_argument("--name", required=True, help="node name")
    p.add_argument("--slots", type=int, default=0, help="how many simulated replicas without GPUs it takes")
    p.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="SIMULATED GPUs: replicas of a deployment with resources.gpuCount 1 (keeps it off real CPU nodes)",
    )
    p.add_argument("--zone", default=None, help="zone (default: the settings' zone)")
    p.add_argument("--transfer-ms", type=float, default=50.0, help="simulated duration of one peer transfer")
    p.add_argument("--pause-ms", type=float, default=0.0, help="simulated duration of a swap inside the pause")
    p.add_argument("--state-bytes", type=int, default=4096, help="size of each replica's simulated weights")
    p = add("node", "run a node agent: report this machine, run the replicas placed on it")
    p.add_argument("--name", default=envs.ROLLOUTS_NODE_NAME.get(), help="node name (default: hostname)")
    p.add_argument(
        "--address",
        default=envs.ROLLOUTS_NODE_ADDRESS.get(),
        help="the address other hosts reach this one at (default: the stack's host address)",
    )
    p.add_argument("--zone", default=envs.ROLLOUTS_NODE_ZONE.get(), help="zone (default: the stack's zone)")
    p.add_argument(
        "--gpus",
        type=int,
        default=_env_int(envs.ROLLOUTS_NODE_GPUS),
        help="GPUs replicas may use (default: the devices CUDA finds)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=_env_int(envs.ROLLOUTS_NODE_SLOTS),
        help="replicas without GPUs this node runs (default: 1 on a host without GPUs, else 0)",
    )
    p.add_argument(
        "--engine-bind",
        default=envs.ROLLOUTS_ENGINE_BIND.get(),
        help="address replica engines bind (default 0.0.0.0; 127.0.0.1 when the node address is loopback)",
    )
    p = add("nodes", "the node agents the control plane knows")
    p.add_argument("name", nargs="?", help="one node")


def _snapshot_command(add: _Add) -> None:
    """Checkpoint tools (workers/snapshot_cli.py parses the rest)."""
    p = add("snapshot", "checkpoint tools: inspect, delta, apply, verify")
    p.add_argument("rest", nargs=argparse.REMAINDER)


def _demo_command(add: _Add) -> None:
    """The main job, end to end (workers/demo.py)."""
    p = add("demo", "the main job, end to end")
    p.add_argument("--port-base", type=int, default=None)
    p.add_argument("--keep-running", action="store_true", help="leave the stack up afterwards")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps, one hot-load each (default 30)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; 4 for qwen3-moe)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt, the GRPO group (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default 16)")
    p.add_argument(
        "--lr", type=float, default=None, help="trainer learning rate (Adam; default 5e-3; 1e-2 for qwen3-moe)"
    )
    p.add_argument(
        "--train",
        choices=["head", "last", "all"],
        default="head",
        help="tensors the trainer updates: lm_head + final norm (default), + the last layer, or all",
    )
    p.add_argument("--inner-steps", type=int, default=1, help="optimizer steps per batch (default 1)")
    p.add_argument(
        "--max-loop-seconds",
        type=float,
        default=300.0,
        help="start no new step after this many seconds of loop (default 300)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model",
        choices=["llama", "qwen3-moe"],
        default="llama",
        help="the embedded Llama model (default), or a small random checkpoint of that family written "
        "locally (qwen3-moe: 8 experts, top 2)",
    )
    p.add_argument("--replicas", type=int, default=2, help="replicas of the deployment (autoscaling.min; default 2)")
    p.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="autoscaling.max: above --replicas, the deployment scales on the demo's own load "
        "(e.g. --replicas 1 --max-replicas 2; default: --replicas)",
    )


def _ops_commands(add: _Add) -> None:
    """Operator commands: token, replay, rollback, hotload wait, history check."""
    p = add("token", "add an API token: rollouts token add --role viewer")
    p.add_argument("action", choices=["add"])
    p.add_argument("--role", choices=["admin", "viewer"], required=True)
    p.add_argument("--org", default=None)
    p.add_argument("--name", default="added")
    p.add_argument("--token", default=None, help="the token value (default: a new random one)")
    p.add_argument("--hot-load-disabled", action="store_true", help="for a new organization: hot-load not enabled")
    p.add_argument(
        "--bucket",
        action="append",
        default=[],
        metavar="BUCKET[/PREFIX]",
        help="grant the organization this bucket (or only keys under PREFIX); repeatable",
    )
    p = add("replay", "start a new hot-load of the same snapshot as HOT_LOAD_ID and wait for it")
    p.add_argument("hot_load_id")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between status reads")
    p = add("rollback", "re-serve IDENTITY, as its newest completed hot-load on the deployment loaded it")
    p.add_argument("identity")
    p.add_argument("--deployment", required=True)
    p.add_argument("--poll", type=float, default=1.0)
    p = add("hotload", "hotload wait HOT_LOAD_ID: print progress until it ends")
    p.add_argument("action", choices=["wait"])
    p.add_argument("hot_load_id")
    p.add_argument("--poll", type=float, default=1.0)
    p = add("history", "history check DIR: replay exported histories against this code")
    p.add_argument("action", choices=["check"])
    p.add_argument("directory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollouts", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--home", help="stack home (default $ROLLOUTS_HOME or ./.rollouts)")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--home", default=argparse.SUPPRESS, help="stack home")
        return p

    for add_commands in (_stack_commands, _replica_commands, _snapshot_command, _demo_command, _ops_commands):
        add_commands(add)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    home = getattr(args, "home", None)
    args.home = Path(home).absolute() if home else home_from_env()
    try:
        return int(handler(args.command)(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback, for operators
        if envs.ROLLOUTS_DEBUG.get():
            raise
        print(f"rollouts {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
