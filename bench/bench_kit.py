"""What the stack benches share, imported by the benches beside it (``bench/`` is on their
``sys.path``):

- ``Api``: JSON calls to ``/v1alpha1/inference`` with the stack's admin token, where any answer
  but 200 ends the bench (``SystemExit`` naming the call, its status and the start of its body).
- ``stack_running``: the embedded stack up for the bench's run, with a list for the SIMULATED
  node agents it starts; on the way out (any way out) the agents stop, the stack goes down, and
  with ``keep`` the home it leaves is named; ``stack_in``: the same for a bench whose stack (with
  its own node agent) lives under its work folder, removed at the end unless ``keep``.
- ``give_base_tokenizer``: the stack's base model's tokenizer files into synthetic checkpoints, so
  a vLLM replica can serve them."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from common.settings import Settings
from tests.helpers.sim_nodes import stop_sim_nodes
from tests.helpers.stack_fixtures import start_stack
from workers.stack import Stack


class Api:
    def __init__(self, settings: Settings, *, timeout: float = 120, excerpt: int = 500) -> None:
        self.http = httpx.Client(
            base_url=f"{settings.api_url}/v1alpha1/inference",
            timeout=timeout,
            headers={"Authorization": f"Bearer {settings.admin_token}"},
        )
        self.excerpt = excerpt  # how much of a refused call's body the exit message shows

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, path, **kw)
        if r.status_code != 200:
            raise SystemExit(f"{method} {path}: {r.status_code} {r.text[: self.excerpt]}")
        return r.json()


@contextmanager
def stack_running(
    settings: Settings, *, node_slots: int, keep: bool, many_pollers: bool = False
) -> Iterator[tuple[Stack, list[subprocess.Popen[bytes]]]]:
    """The stack, up (its lines printed), and the list of SIMULATED node agents to stop at the end."""
    stack = Stack(settings, node_slots=node_slots, many_pollers=many_pollers)
    stack.up(say=lambda line: print(line, flush=True))
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        yield stack, nodes
    finally:
        stop_sim_nodes(nodes)
        stack.down(say=lambda line: None)
        if keep:
            print(f"home kept: {settings.home_path}")


@contextmanager
def stack_in(work: Path, *, keep: bool, kept_note: str = "") -> Iterator[tuple[Stack, Settings]]:
    """The stack with its home at ``work/home``; on the way out it goes down and ``work`` is
    removed, or with ``keep`` named (after ``kept_note``)."""
    stack, settings = start_stack(work / "home")
    try:
        yield stack, settings
    finally:
        stack.down(say=lambda line: None)
        if keep:
            print(f"kept {work}{kept_note}")
        else:
            shutil.rmtree(work, ignore_errors=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def give_base_tokenizer(settings: Settings, *dirs: Path) -> None:
    """Copy the stack's base model's tokenizer files into each of ``dirs``."""
    for d in dirs:
        for f in TOKENIZER_FILES:
            shutil.copy2(settings.home_path / "models" / "base" / f, d / f)


def deployment_body(
    settings: Settings, name: str, *, gpus: int, autoscaling: dict[str, Any], hot_load: dict[str, Any]
) -> dict[str, Any]:
    """A POST /deployments body: ``name``, a dynamo-vllm deployment of the stack's base model on
    cpu-local instances of ``gpus`` (simulated) GPUs, hot-loading from the stack's bucket
    (``hot_load``: the section's other fields)."""
    return {
        "name": name,
        "gatewayIds": [settings.gateway_id],
        "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
        "model": {"name": f"{name}-model", "bucket": settings.bucket, "path": settings.base_model_path},
        "resources": {"instanceType": "cpu-local", "gpuCount": gpus},
        "autoscaling": autoscaling,
        "hotLoad": {"bucket": settings.bucket, **hot_load},
    }
