"""rollouts' vLLM general plugin: ``vllm.general_plugins`` entry point ``rollouts`` (pyproject).

vLLM calls :func:`register` in each of its processes (API server, engine core, workers) before
the engine starts. What it does:

- On CPU platforms, it shortens vLLM's idle busy-poll. A reader of vLLM's shared-memory message
  queue (``shm_broadcast.SpinCondition``) spins with ``sched_yield`` for ``busy_loop_s`` = 1 s
  after every message before it sleeps on a socket, in the worker (reading the engine core's
  RPCs and steps) and in the engine core (reading the workers' replies). On a CPU host shared by
  several replicas, every RPC (a stage, a status poll, a pause) thus burned a core per process
  for a second, and the hot-load's own decode, transfer and swap crawled behind the spinning.
  ``ROLLOUTS_VLLM_SPIN_S`` (default 0.05 s) caps that window: under load, engine steps follow
  each other far faster than that, so serving still never sleeps between steps; idle, a reader
  wakes from its socket in microseconds. GPU hosts keep vLLM's default.

Nothing here changes what vLLM computes; a process without vLLM is unaffected.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("rollouts.vllm_plugin")

DEFAULT_SPIN_S = 0.05


def register() -> None:
    shorten_idle_spin()


def idle_spin_cap() -> float | None:
    """The cap :func:`shorten_idle_spin` installed in this process, or None."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except Exception:  # noqa: BLE001
        return None
    return getattr(shm_broadcast.SpinCondition.wait, "_rollouts_cap", None)


def shorten_idle_spin() -> bool:
    """Cap the shared-memory queue readers' busy-poll window on CPU platforms; True if applied."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 - another vLLM layout: leave it alone
        return False
    if not current_platform.is_cpu():
        return False
    spin = shm_broadcast.SpinCondition
    if getattr(spin.wait, "_rollouts_cap", None) is not None:
        return True
    cap = float(os.environ.get("ROLLOUTS_VLLM_SPIN_S", DEFAULT_SPIN_S))
    original = spin.wait

    def wait(self: object, timeout_ms: int | None = None) -> None:
        if getattr(self, "busy_loop_s", 0) > cap:
            self.busy_loop_s = cap  # type: ignore[attr-defined]
        return original(self, timeout_ms)

    wait._rollouts_cap = cap  # type: ignore[attr-defined]
    spin.wait = wait  # type: ignore[method-assign]
    logger.info("vLLM's idle busy-poll capped at %.3f s (ROLLOUTS_VLLM_SPIN_S)", cap)
    return True
