"""Run at the start of every Python process of a CPU engine that returns routed experts (the
replica agent puts this folder first on the engine's ``PYTHONPATH``: engine_process.py, together
with ``TRITON_INTERPRET=1`` and ``VLLM_USE_V2_MODEL_RUNNER=1``).

vLLM returns routed experts only from its Model Runner V2, whose input preparation, sampling and
routing capture are Triton kernels. vLLM's CPU build accepts Triton only with a ``cpu`` backend
(triton-cpu), which the Triton on PyPI lacks, so without this the engine refuses to start
("Model Runner V2 requires Triton"). This registers an inactive ``cpu`` backend entry before vLLM
is imported (vLLM decides at import, in ``vllm.triton_utils.importing``); Triton's interpreter
(``TRITON_INTERPRET=1``) then runs every kernel on the host. Same tokens and logprobs as the V1
runner, about 30 ms more per engine step (docs/field-notes.md). A GPU engine never gets this.
Python runs one ``sitecustomize``: the next one on ``sys.path`` (the environment's own, if any)
runs after this one.
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
