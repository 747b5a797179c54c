"""Run at the start of every Python process of a CPU engine that returns routed experts (the
agent puts this folder first on its ``PYTHONPATH`` with ``TRITON_INTERPRET=1`` and
``VLLM_USE_V2_MODEL_RUNNER=1``: `replica.launch`).

vLLM returns routed experts only from Model Runner V2, whose kernels are Triton's, and its CPU
build accepts Triton only with a ``cpu`` backend that PyPI's Triton lacks. This registers an
inactive ``cpu`` backend before vLLM is imported; Triton's interpreter then runs every kernel on
the host (same tokens and logprobs, ~30 ms more a step: docs/field-notes.md). A GPU engine never
gets this; the environment's own ``sitecustomize``, if any, runs after this one.
"""

import contextlib
import importlib.machinery
import importlib.util
import os
import sys


class _InactiveDriver:
    @staticmethod
    def is_active() -> bool:
        return False


class _InterpretedCPU:
    driver = _InactiveDriver


with contextlib.suppress(ImportError):  # a process without Triton has no kernels to interpret
    from triton.backends import backends

    backends.setdefault("cpu", _InterpretedCPU)


def _run_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_the_next_sitecustomize()
