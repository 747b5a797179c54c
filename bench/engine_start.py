"""Measure: how long a replica's engine takes to start (vLLM's OpenAI server on CPU, the embedded
small model, `replica.agent.engine_process.EngineProcess` as the replica agent starts it, until
it serves), with the host's shared model-class record (``model_info_cache``, what the agent
gives every engine) against without it (every start inspects the model class in a child process
that imports vLLM again), side by side in one run, alternating.

It prints each start's seconds, then the medians and their ratio. The first start with the
shared record fills it (it is not counted as "shared").

    .venv/bin/python bench/engine_start.py --runs 3
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

from replica.agent.engine_process import EngineProcess  # noqa: E402
from workers.base_model import write_base_model  # noqa: E402


async def start_once(model: Path, root: Path, shared: Path | None) -> float:
    work = Path(tempfile.mkdtemp(prefix="start-", dir=root))
    engine = EngineProcess(model, work_dir=work, served_model_name="bench", model_info_cache=shared)
    t0 = time.monotonic()
    await engine.start(timeout=900)
    took = time.monotonic() - t0
    await engine.stop()
    shutil.rmtree(work, ignore_errors=True)
    return took


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="starts of each kind")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="engine-start-", dir="/tmp"))
    try:
        model = write_base_model(root / "base")
        shared = root / "modelinfos"
        print(f"filling the shared record: {await start_once(model, root, shared):.1f} s")
        times: dict[str, list[float]] = {"without": [], "shared": []}
        for run in range(args.runs):
            for kind in ("without", "shared"):
                took = await start_once(model, root, shared if kind == "shared" else None)
                times[kind].append(took)
                print(f"run {run + 1}: {kind:>7} {took:.1f} s")
        without, with_shared = statistics.median(times["without"]), statistics.median(times["shared"])
        print(f"median start: without the shared record {without:.1f} s, with it {with_shared:.1f} s: "
              f"{without / with_shared:.2f}x faster ({without - with_shared:.1f} s saved per engine start)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
