"""rollouts' vLLM general plugin: ``vllm.general_plugins`` entry point ``rollouts`` (pyproject.toml).

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
- On CPU platforms, it runs the sampler's logprob ranks eagerly. vLLM wraps
  ``batched_count_greater_than`` (each sampled token's rank, computed for every request that
  asks for logprobs) in ``torch.compile``, compiled lazily by inductor, i.e. g++, on the first
  such request: on a small CPU host that stalls the engine (every running request, pauses and
  RPCs included) for the whole build, long enough for a peer's broadcast to time out behind it
  (timings: bench/README.md). The eager ``(x >= values).sum(-1)`` is the same integer count; its
  temporary is a bool per logit (a quarter of the float32 logprobs tensor already there). GPU
  hosts keep the compiled kernel.

Nothing here changes what vLLM computes; a process without vLLM is unaffected.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from common import envs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("rollouts.vllm_plugin")

DEFAULT_SPIN_S = envs.ROLLOUTS_VLLM_SPIN_S.default


def register() -> None:
    shorten_idle_spin()
    eager_logprob_ranks()


def idle_spin_cap() -> float | None:
    """The cap :func:`shorten_idle_spin` installed in this process, or None."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
    except Exception:  # noqa: BLE001
        return None
    return getattr(shm_broadcast.SpinCondition.wait, "_rollouts_cap", None)


def shorten_idle_spin() -> bool:
    """Cap the shared-memory queue readers' busy-poll window on CPU platforms; True if applied."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
        from vllm.platforms import current_platform  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
    except Exception:  # noqa: BLE001 - another vLLM layout: leave it alone
        return False
    if not current_platform.is_cpu():
        return False
    spin = shm_broadcast.SpinCondition
    if getattr(spin.wait, "_rollouts_cap", None) is not None:
        return True
    cap = envs.ROLLOUTS_VLLM_SPIN_S.get()
    original = spin.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "busy_loop_s", 0) > cap:
            self.busy_loop_s = cap
        return original(self, timeout_ms)

    wait._rollouts_cap = cap  # type: ignore[attr-defined]
    spin.wait = wait  # type: ignore[method-assign]
    logger.info("vLLM's idle busy-poll capped at %.3f s (ROLLOUTS_VLLM_SPIN_S)", cap)
    return True


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x``, how many elements are >= that row's ``values`` entry (what vLLM's
    compiled ``batched_count_greater_than`` returns), eagerly."""
    return (x >= values).sum(-1)


def eager_logprob_ranks() -> bool:
    """On CPU platforms, point vLLM's sampler at :func:`count_at_least` instead of its lazily
    compiled ``batched_count_greater_than``; True if applied (idempotent)."""
    try:
        from vllm.platforms import current_platform  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
        from vllm.v1.sample import sampler  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
        from vllm.v1.sample.ops import logprobs  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
    except Exception:  # noqa: BLE001 - another vLLM layout: leave it alone
        return False
    if not current_platform.is_cpu():
        return False
    # The sampler imported the function by name: replace both references.
    if sampler.batched_count_greater_than is count_at_least:
        return True
    for module in (logprobs, sampler):
        if hasattr(module, "batched_count_greater_than"):
            module.batched_count_greater_than = count_at_least  # type: ignore[attr-defined]
    logger.info("vLLM's sampler counts logprob ranks eagerly (no inductor compile on the first logprobs request)")
    return sampler.batched_count_greater_than is count_at_least


def logprob_ranks_eager() -> bool:
    """Whether this process's vLLM sampler counts logprob ranks with :func:`count_at_least`."""
    try:
        from vllm.v1.sample import sampler  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
    except Exception:  # noqa: BLE001
        return False
    return getattr(sampler, "batched_count_greater_than", None) is count_at_least
