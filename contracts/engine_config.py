"""Rules on ``runtime.engineConfig`` that the API (on create) and the deployment workflow (on an
update, against the deployment's resources) both apply."""

from __future__ import annotations

from contracts.records import Resources, Runtime

TP_KEY = "tensor-parallel-size"
EP_KEY = "enable-expert-parallel"


def tensor_parallel_size(runtime: Runtime) -> int:
    return int(runtime.engine_config.get(TP_KEY, "1") or 1)


def tensor_parallel_problem(runtime: Runtime | None, resources: Resources | None) -> str | None:
    """Each replica's engine runs ``tensor-parallel-size`` ranks, one GPU each: ``gpuCount`` (the
    GPUs a replica gets) must be a multiple of it (0 on a CPU instance type, whose ranks take a
    core each)."""
    if runtime is None or resources is None:
        return None
    tp = tensor_parallel_size(runtime)
    if resources.gpu_count % tp:
        return (
            f"resources.gpuCount ({resources.gpu_count}) must be a multiple of runtime.engineConfig "
            f"{TP_KEY} ({tp}): each tensor-parallel rank takes one GPU"
        )
    return None


def expert_parallel_problem(runtime: Runtime | None, resources: Resources | None) -> str | None:
    """``enable-expert-parallel`` spreads a MoE model's experts over the tensor-parallel ranks,
    each holding its own experts whole: it needs ``tensor-parallel-size`` 2 or more, and GPU
    replicas (``gpuCount`` > 0): vLLM's CPU experts kernel ignores the expert map and crashes at
    the first forward pass (docs/field-notes.md)."""
    if runtime is None or EP_KEY not in runtime.engine_config:
        return None
    if tensor_parallel_size(runtime) < 2:
        return (
            f"runtime.engineConfig {EP_KEY} splits the experts over the tensor-parallel ranks: it needs "
            f"{TP_KEY} 2 or more"
        )
    if resources is not None and resources.gpu_count == 0:
        return (
            f"runtime.engineConfig {EP_KEY} needs GPU replicas (resources.gpuCount > 0): vLLM's CPU "
            "experts kernel does not run expert parallelism"
        )
    return None


def engine_config_problem(runtime: Runtime | None, resources: Resources | None) -> str | None:
    """The first of the rules above that ``runtime.engineConfig`` and ``resources`` break, if any."""
    return tensor_parallel_problem(runtime, resources) or expert_parallel_problem(runtime, resources)
