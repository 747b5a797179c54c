"""rollouts' vLLM general plugin: ``vllm.general_plugins`` entry point ``rollouts`` (pyproject.toml).

vLLM calls :func:`register` in each of its processes before the engine starts. On CPU platforms
only, it caps the idle busy-poll of vLLM's shared-memory queue readers at
``ROLLOUTS_VLLM_SPIN_S`` (default 0.05 s instead of 1 s, which burned a core per process after
every RPC on a shared host), and runs the sampler's logprob ranks eagerly (the same integer
count; avoids a lazy inductor compile that stalls the engine on its first logprobs request;
bench/README.md), and runs a tensor-parallel embedding's token-id masking eagerly (vLLM's own
function, uncompiled: integer arithmetic, the same ids; its inductor compile cost each rank of
every tensor-parallel engine ~15 CPU-s on its first request); it also turns the cyclic garbage
collector back on where a spawned process of ours turned it off for vLLM's import
(replica/engine/dynamo_worker.py). Invariant: nothing here changes what vLLM computes; GPU hosts
and processes without vLLM are unaffected.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING, Any

from common import envs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("rollouts.vllm_plugin")

DEFAULT_SPIN_S = envs.ROLLOUTS_VLLM_SPIN_S.default


def register() -> None:
    if not gc.isenabled():  # off in a process vLLM spawned, while it imported vLLM (replica/engine/dynamo_worker.py)
        gc.enable()
        logger.info("the garbage collector is back on after vLLM's import")
    shorten_idle_spin()
    eager_logprob_ranks()
    eager_vocab_masks()


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


def eager_vocab_masks() -> bool:
    """On CPU platforms, run vLLM's ``get_masked_input_and_mask`` (a tensor-parallel embedding's
    token ids shifted into this rank's shard, and the mask of the others) as the plain function
    ``torch.compile`` wraps; True if applied (idempotent)."""
    try:
        from vllm.model_executor.layers import vocab_parallel_embedding as vocab  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
        from vllm.platforms import current_platform  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
    except Exception:  # noqa: BLE001 - another vLLM layout: leave it alone
        return False
    if not current_platform.is_cpu():
        return False
    compiled = getattr(vocab, "get_masked_input_and_mask", None)
    plain = getattr(compiled, "_torchdynamo_orig_callable", None)
    if plain is not None:
        vocab.get_masked_input_and_mask = plain
        logger.info("vLLM's tensor-parallel embedding masks token ids eagerly (no inductor compile)")
    return vocab_masks_eager()


def vocab_masks_eager() -> bool:
    """Whether this process's vLLM embedding masks token ids with the uncompiled function."""
    try:
        from vllm.model_executor.layers import vocab_parallel_embedding as vocab  # noqa: PLC0415 - vLLM loads plugins while it imports itself; a layout without these modules is skipped
    except Exception:  # noqa: BLE001
        return False
    fn = getattr(vocab, "get_masked_input_and_mask", None)
    return fn is not None and not hasattr(fn, "_torchdynamo_orig_callable")
