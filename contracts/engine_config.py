"""Rules on ``runtime.engineConfig`` that the API (on create) and the deployment workflow (on an
update, against the deployment's resources) both apply."""

from __future__ import annotations

from contracts.records import Resources, Runtime

TP_KEY = "tensor-parallel-size"


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
        return (f"resources.gpuCount ({resources.gpu_count}) must be a multiple of runtime.engineConfig "
                f"{TP_KEY} ({tp}): each tensor-parallel rank takes one GPU")
    return None
