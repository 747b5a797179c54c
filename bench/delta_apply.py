"""Benchmark: delta apply throughput, ours vs cwtrain's WeightMirror vs the raw codec limit.

Builds a realistic BF16 checkpoint pair (one Adam step at lr 1e-6, see snapshots.synthetic),
writes the delta once, then on the same files measures, in GB/s of changed tensor bytes:

* ours: ``HostWeights.load(base).apply_delta(delta)`` in a fresh process, the base loaded in
  memory beforehand as a replica holds it (also its peak RSS, and how much the apply added);
* cwtrain: ``WeightMirror.apply_delta`` (mirror created beforehand, untimed) in cwtrain's venv;
* raw: frames and base tensors already in memory, parallel zstd decompress + XOR + Adler-32.

    .venv/bin/python bench/delta_apply.py --size-mb 1024     # the issue's size (default)
    .venv/bin/python bench/delta_apply.py --size-mb 128      # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zstandard

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from snapshots.codec import default_workers  # noqa: E402
from snapshots.inspect import read_delta_plan  # noqa: E402
from snapshots.synthetic import make_checkpoint_pair  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402

# ru_maxrss survives fork+exec on Linux (it would report the parent's peak); VmHWM does not.
OURS = """
import json, sys, time
sys.path.insert(0, sys.argv[3])
from snapshots.host import HostWeights
def hwm_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
w = HostWeights.load(sys.argv[1], verify=False)
rss0 = hwm_mb()
t = time.perf_counter(); r = w.apply_delta_report(sys.argv[2]); dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "bytes_changed": r.bytes_changed, "changed": len(r.changed),
                  "peak_rss_mb": hwm_mb(), "rss_before_apply_mb": rss0}))
"""

CWTRAIN = """
import json, sys, time
from cwtrain.hotload import WeightMirror
m = WeightMirror.create(sys.argv[1], sys.argv[3])
t = time.perf_counter(); r = m.apply_delta(sys.argv[2]); dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "bytes_changed": r.bytes_changed, "changed": r.tensors_changed}))
"""


def raw_limit(base: Path, delta: Path, workers: int) -> dict[str, float]:
    from snapshots.host import HostWeights

    weights = HostWeights.load(base)
    plan = read_delta_plan(delta)
    frames = {t.name: plan.source.read_range(t.file, t.begin, t.wire_bytes) for t in plan.tensors.values()}
    targets = {n: weights.raw(n).copy() for n in frames}
    local = __import__("threading").local()

    def one(name: str) -> None:
        target = targets[name]
        scratch = getattr(local, "s", None)
        if scratch is None or scratch.nbytes < target.nbytes:
            scratch = local.s = np.empty(target.nbytes, np.uint8)
        out = scratch[: target.nbytes]
        with zstandard.ZstdDecompressor().stream_reader(frames[name]) as reader:
            reader.readinto(memoryview(out))
        np.bitwise_xor(target, out, out=target)
        zlib.adler32(target)

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, frames))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes_changed": sum(t.nbytes for t in targets.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--workdir", type=Path, help="where to build the checkpoints (default: a temp dir)")
    parser.add_argument("--cwtrain-python", default=os.environ.get("ROLLOUTS_CWTRAIN_PYTHON", str(REPO / ".venv-cw/bin/python")))
    args = parser.parse_args()
    workers = default_workers()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        summary = make_checkpoint_pair(root / "base", root / "new", size_mb=args.size_mb)
        print(f"generated {summary['tensor_bytes'] / 1e9:.2f} GB BF16 pair in {time.perf_counter() - t:.0f}s; "
              f"{100 * summary['changed_element_fraction']:.2f}% of elements changed", flush=True)
        stats = write_delta(root / "base", root / "new", root / "delta", version="000001", base_version="000000")
        print(f"delta: {stats.changed}/{stats.tensors_total} tensors, {stats.wire_bytes / 1e6:.1f} MB on the wire "
              f"({100 * stats.ratio:.2f}% of full)", flush=True)
        results: dict[str, dict[str, float]] = {}
        run = subprocess.run([sys.executable, "-c", OURS, str(root / "base"), str(root / "delta"), str(REPO)],
                             capture_output=True, text=True, check=True)
        results["ours"] = json.loads(run.stdout)
        if Path(args.cwtrain_python).exists():
            run = subprocess.run([args.cwtrain_python, "-c", CWTRAIN, str(root / "base"), str(root / "delta"), str(root / "mirror")],
                                 capture_output=True, text=True, check=True)
            results["cwtrain"] = json.loads(run.stdout.strip().splitlines()[-1])
        results["raw"] = raw_limit(root / "base", root / "delta", workers)
    print(f"workers: {workers}; model tensor bytes: {summary['tensor_bytes'] / 1e6:.0f} MB")
    for name, r in results.items():
        r["gbps"] = r["bytes_changed"] / r["seconds"] / 1e9
        extra = f", peak RSS {r['peak_rss_mb']:.0f} MB (+{r['peak_rss_mb'] - r['rss_before_apply_mb']:.0f} MB during the apply)" if "peak_rss_mb" in r else ""
        print(f"{name:8s} {r['seconds']:7.3f}s  {r['gbps']:6.2f} GB/s of changed bytes{extra}")
    if "cwtrain" in results:
        print(f"ours / cwtrain mirror: {results['ours']['gbps'] / results['cwtrain']['gbps']:.1f}x")
    print(f"ours / raw limit: {100 * results['ours']['gbps'] / results['raw']['gbps']:.0f}%")


if __name__ == "__main__":
    main()
