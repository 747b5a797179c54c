"""`rollouts`: the command line of the service.

    rollouts up | down | status        the embedded stack on 127.0.0.1 (`make up` / `make down`)
    rollouts demo [--steps N ...]      up, a 2-replica deployment, a tiny GRPO loop that learns
                                       through delta hot-loads, a plot and a table, down
    rollouts api | worker | gateway    one service process (what `up` starts)
    rollouts replica ...               one replica (started by the control worker)
    rollouts snapshot ...              inspect / delta / apply / verify checkpoints (snapshots/)
    rollouts token add ...             add an API token to the tokens file
    rollouts replay HOT_LOAD_ID        a new hot-load of the same snapshot, waited for (workers/ops.py)
    rollouts rollback IDENTITY --deployment D    re-serve an earlier completed snapshot
    rollouts hotload wait HOT_LOAD_ID  print progress until the operation ends
    rollouts history check DIR         replay exported workflow histories against this code

Every command exits non-zero with a one-line reason on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
from pathlib import Path

from common.settings import home_from_env


def _home(args: argparse.Namespace) -> Path:
    return Path(args.home).absolute() if args.home else home_from_env()


def _settings(args: argparse.Namespace):
    from common.settings import Settings

    return Settings.load(_home(args))


def _logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per engine call is noise in the replica and gateway logs.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def cmd_up(args: argparse.Namespace) -> int:
    from workers.stack import Stack, load_or_create_settings

    settings = load_or_create_settings(_home(args), args.port_base)
    Stack(settings).up()
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from common.settings import Settings
    from workers.stack import Stack

    home = _home(args)
    if not (home / "stack.json").exists():
        print(f"no stack at {home}; nothing to stop")
        return 0
    Stack(Settings.load(home)).down()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from workers.stack import Stack

    stack = Stack(_settings(args))
    for name, pid in stack.status().items():
        print(f"{name:<28} {'running (pid %d)' % pid if pid else 'stopped'}")
    print(stack.describe())
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app

    _logging()
    settings = _settings(args)
    uvicorn.run(create_app(settings), host="127.0.0.1", port=settings.ports["api"], log_level="warning")
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_gateway_app

    _logging()
    settings = _settings(args)
    uvicorn.run(create_gateway_app(settings), host="127.0.0.1", port=settings.ports["gateway"], log_level="warning")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.control_worker import run_control_worker

    _logging()
    asyncio.run(run_control_worker(_settings(args)))
    return 0


def cmd_replica(args: argparse.Namespace) -> int:
    from replica.agent.process import run_replica

    _logging()
    return asyncio.run(
        run_replica(
            _settings(args),
            deployment_id=args.deployment,
            name=args.name,
            workflow_id=args.workflow_id,
            zone=args.zone,
            model_bucket=args.model_bucket,
            model_path=args.model_path,
            model_name=args.model_name,
            catch_up=args.catch_up,
            engine_config=json.loads(args.engine_config),
        )
    )


def cmd_snapshot(args: argparse.Namespace) -> int:
    from snapshots.cli import main as snapshot_main

    return snapshot_main(args.rest)


def cmd_token_add(args: argparse.Namespace) -> int:
    from common.tokens import add_token

    settings = _settings(args)
    token = args.token or f"rk-{args.role}-{secrets.token_urlsafe(24)}"
    try:
        add_token(settings.tokens_file, token, args.role, args.org or settings.organization_id, args.name,
                  hot_load_enabled=not args.hot_load_disabled, buckets=args.bucket)
    except ValueError as exc:
        print(f"rollouts token add: {exc}", file=sys.stderr)
        return 2
    print(token)  # the only time it is shown: tokens.json keeps its hash
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from workers.demo import DemoConfig, run_demo

    config = DemoConfig(
        steps=args.steps, prompts=args.prompts, group=args.group, max_tokens=args.max_tokens,
        lr=args.lr, train=args.train, inner_steps=args.inner_steps, max_loop_s=args.max_loop_seconds, seed=args.seed,
    )
    return run_demo(_home(args), port_base=args.port_base, keep_running=args.keep_running, config=config)


def cmd_replay(args: argparse.Namespace) -> int:
    from workers.ops import replay, run

    return run(lambda http: replay(http, args.hot_load_id, out=sys.stdout, poll_s=args.poll), _home(args))


def cmd_rollback(args: argparse.Namespace) -> int:
    from workers.ops import rollback, run

    return run(lambda http: rollback(http, args.identity, args.deployment, out=sys.stdout, poll_s=args.poll), _home(args))


def cmd_hotload_wait(args: argparse.Namespace) -> int:
    from workers.ops import run, wait_and_report

    return run(lambda http: wait_and_report(http, args.hot_load_id, out=sys.stdout, poll_s=args.poll), _home(args))


def cmd_history_check(args: argparse.Namespace) -> int:
    from workers.ops import OpsError, history_check

    try:
        return asyncio.run(history_check(Path(args.directory), out=sys.stdout))
    except OpsError as exc:
        print(f"rollouts: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollouts", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", help="stack home (default $ROLLOUTS_HOME or ./.rollouts)")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--home", default=argparse.SUPPRESS, help="stack home")
        p.set_defaults(fn=fn)
        return p

    p = add("up", cmd_up, "start the embedded stack")
    p.add_argument("--port-base", type=int, default=None, help="first port of the stack's range (default 17200)")
    add("down", cmd_down, "stop everything the stack started")
    add("status", cmd_status, "what runs")
    add("api", cmd_api, "run the API server")
    add("worker", cmd_worker, "run the control-plane worker")
    add("gateway", cmd_gateway, "run the gateway")
    p = add("replica", cmd_replica, "run one replica (engine + agent)")
    for flag in ("--deployment", "--name", "--workflow-id", "--zone", "--model-bucket", "--model-path", "--model-name"):
        p.add_argument(flag, required=True)
    p.add_argument("--engine-config", default="{}", help="JSON runtime.engineConfig: vLLM flags")
    p.add_argument("--catch-up", default=None, help="JSON ApplySnapshotInput to load before reporting ready")
    p = add("snapshot", cmd_snapshot, "checkpoint tools: inspect, delta, apply, verify")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p = add("demo", cmd_demo, "the main job, end to end")
    p.add_argument("--port-base", type=int, default=None)
    p.add_argument("--keep-running", action="store_true", help="leave the stack up afterwards")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps, one hot-load each (default 30)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt, the GRPO group (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default 16)")
    p.add_argument("--lr", type=float, default=5e-3, help="trainer learning rate (Adam; default 5e-3)")
    p.add_argument("--train", choices=["head", "last", "all"], default="head",
                   help="tensors the trainer updates: lm_head + final norm (default), + the last layer, or all")
    p.add_argument("--inner-steps", type=int, default=1, help="optimizer steps per batch (default 1)")
    p.add_argument("--max-loop-seconds", type=float, default=300.0,
                   help="start no new step after this many seconds of loop (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p = add("token", cmd_token_add, "add an API token: rollouts token add --role viewer")
    p.add_argument("action", choices=["add"])
    p.add_argument("--role", choices=["admin", "viewer"], required=True)
    p.add_argument("--org", default=None)
    p.add_argument("--name", default="added")
    p.add_argument("--token", default=None, help="the token value (default: a new random one)")
    p.add_argument("--hot-load-disabled", action="store_true", help="for a new organization: hot-load not enabled")
    p.add_argument("--bucket", action="append", default=[], metavar="BUCKET[/PREFIX]",
                   help="grant the organization this bucket (or only keys under PREFIX); repeatable")
    p = add("replay", cmd_replay, "start a new hot-load of the same snapshot as HOT_LOAD_ID and wait for it")
    p.add_argument("hot_load_id")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between status reads")
    p = add("rollback", cmd_rollback, "re-serve IDENTITY, as its newest completed hot-load on the deployment loaded it")
    p.add_argument("identity")
    p.add_argument("--deployment", required=True)
    p.add_argument("--poll", type=float, default=1.0)
    p = add("hotload", cmd_hotload_wait, "hotload wait HOT_LOAD_ID: print progress until it ends")
    p.add_argument("action", choices=["wait"])
    p.add_argument("hot_load_id")
    p.add_argument("--poll", type=float, default=1.0)
    p = add("history", cmd_history_check, "history check DIR: replay exported histories against this code")
    p.add_argument("action", choices=["check"])
    p.add_argument("directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "home", None) is None:
        args.home = os.environ.get("ROLLOUTS_HOME")
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback, for operators
        from workers.stack import StackError

        if isinstance(exc, (StackError, SystemExit)):
            print(f"rollouts: {exc}", file=sys.stderr)
            return 1
        if os.environ.get("ROLLOUTS_DEBUG"):
            raise
        print(f"rollouts {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
