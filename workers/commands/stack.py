"""`rollouts up | down | status` and `rollouts token add`: the embedded stack in a home.

`up`, `down` and `status` act on the stack the home owns, with its ``stack.json`` as written
(``Settings.own``): another stack's variables in the shell (a sourced ``stack.env``) neither
redirect them nor the processes `up` starts (workers/stack.py). `token add` is a client's: the
environment's ``ROLLOUTS_TOKENS_FILE`` and names apply (``Settings.load``)."""

from __future__ import annotations

import argparse
import secrets
import sys

from common.settings import Settings
from contracts.tokens import add_token
from workers.commands import settings_of
from workers.stack import DEFAULT_NODE_SLOTS, Stack, StackError, load_or_create_settings


def up(args: argparse.Namespace) -> int:
    try:
        slots = args.node_slots if args.node_slots is not None else DEFAULT_NODE_SLOTS
        settings = load_or_create_settings(args.home, args.port_base, getattr(args, "host", None))
        if getattr(args, "dynamo_router_mode", None):
            settings.dynamo_router_mode = args.dynamo_router_mode
        Stack(settings, node_slots=slots).up()
    except StackError as exc:
        print(f"rollouts: {exc}", file=sys.stderr)
        return 1
    return 0


def down(args: argparse.Namespace) -> int:
    if not (args.home / "stack.json").exists():
        print(f"no stack at {args.home}; nothing to stop")
        return 0
    try:
        Stack(Settings.own(args.home)).down()
    except StackError as exc:
        print(f"rollouts: {exc}", file=sys.stderr)
        return 1
    return 0


def status(args: argparse.Namespace) -> int:
    stack = Stack(Settings.own(args.home))
    for name, pid in stack.status().items():
        print(f"{name:<28} {'running (pid %d)' % pid if pid else 'stopped'}")
    print(stack.describe())
    return 0


def token_add(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    token = args.token or f"rk-{args.role}-{secrets.token_urlsafe(24)}"
    try:
        add_token(
            settings.tokens_file,
            token,
            args.role,
            args.org or settings.organization_id,
            args.name,
            hot_load_enabled=not args.hot_load_disabled,
            buckets=args.bucket,
        )
    except ValueError as exc:
        print(f"rollouts token add: {exc}", file=sys.stderr)
        return 2
    print(token)  # the only time it is shown: tokens.json keeps its hash
    return 0
