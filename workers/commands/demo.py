"""`rollouts demo`: the main job end to end (workers/demo.py)."""

from __future__ import annotations

import argparse
import sys

from workers.demo import MODEL_DEFAULTS, DemoConfig, run_demo
from workers.stack import StackError


def main(args: argparse.Namespace) -> int:
    prompts, lr = MODEL_DEFAULTS[args.model]
    config = DemoConfig(
        steps=args.steps,
        prompts=prompts if args.prompts is None else args.prompts,
        group=args.group,
        max_tokens=args.max_tokens,
        lr=lr if args.lr is None else args.lr,
        train=args.train,
        inner_steps=args.inner_steps,
        max_loop_s=args.max_loop_seconds,
        seed=args.seed,
        replicas=args.replicas,
        max_replicas=args.max_replicas,
        model=args.model,
    )
    try:
        return run_demo(args.home, port_base=args.port_base, keep_running=args.keep_running, config=config)
    except StackError as exc:
        print(f"rollouts: {exc}", file=sys.stderr)
        return 1
