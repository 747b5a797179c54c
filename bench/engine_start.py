"""Measure: how long a replica's engine takes to start (vLLM's OpenAI server on CPU, the embedded
small model, `replica.agent.engine_process.EngineProcess` as the replica agent starts it, until
it serves), two ways side by side in one run, alternating:

- ``--compare model-infos``: with the host's shared model-class record (``model_info_cache``,
  what the agent gives every engine) against without it (every start inspects the model class in
  a child process that imports vLLM again). The first start with the shared record fills it
  (it is not counted).
- ``--compare worker`` (both with the shared record): a one-rank engine's worker inside its
  engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what the agent starts with vLLM's CPU build)
  against a worker process of its own (vLLM's default on CPU: one more process importing vLLM).

It prints each start's seconds, then the medians and their ratio.

    .venv/bin/python bench/engine_start.py --runs 3 [--compare worker]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from replica.agent.engine_process import INPROC_WORKER_ENV, EngineProcess  # noqa: E402
from workers.base_model import write_base_model  # noqa: E402


async def start_once(model: Path, root: Path, shared: Path | None, env: dict[str, str] | None = None) -> float:
    work = Path(tempfile.mkdtemp(prefix="start-", dir=root))
    engine = EngineProcess(model, work_dir=work, served_model_name="bench", model_info_cache=shared, env=env)
    t0 = time.monotonic()
    await engine.start(timeout=900)
    took = time.monotonic() - t0
    await engine.stop()
    shutil.rmtree(work, ignore_errors=True)
    return took


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="starts of each kind")
    parser.add_argument("--compare", choices=("model-infos", "worker"), default="model-infos")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="engine-start-", dir="/tmp"))
    try:
        model = write_base_model(root / "base")
        shared = root / "modelinfos"
        print(f"filling the shared record: {await start_once(model, root, shared):.1f} s")
        if args.compare == "model-infos":
            kinds = {"without the shared record": (None, None), "with it": (shared, None)}
        else:
            kinds = {
                "a worker process": (shared, {INPROC_WORKER_ENV: "1"}),
                "the worker in the engine core": (shared, {INPROC_WORKER_ENV: "0"}),
            }
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for run in range(args.runs):
            for kind, (cache, env) in kinds.items():
                took = await start_once(model, root, cache, env)
                times[kind].append(took)
                print(f"run {run + 1}: {kind}: {took:.1f} s")
        (before, b), (after, a) = ((k, statistics.median(v)) for k, v in times.items())
        print(
            f"median start: {before} {b:.1f} s, {after} {a:.1f} s: {b / a:.2f}x faster "
            f"({b - a:.1f} s saved per engine start)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
