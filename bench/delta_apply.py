"""Benchmark: delta apply throughput, ours vs cwtrain's WeightMirror vs the raw codec limit.

Builds a realistic BF16 checkpoint pair (one Adam step at lr 1e-6, see snapshots.synthetic),
writes the delta once, then on the same files measures, in GB/s of changed tensor bytes:

* ours: ``materialize_chain_report(base, [delta], out)`` in a fresh process: the streamed apply
  that reads the base checkpoint directory and writes the new one (files in, files out, like
  cwtrain's mirror), with its peak RSS against the model size. Once as shipped (``fsync=True``:
  the new files are on disk before they replace ``out``) and once with ``fsync=False``;
* cwtrain: ``WeightMirror.apply_delta`` into a mirror directory created beforehand (untimed), in
  cwtrain's venv. It stages the new bytes, fsyncs, then writes them into the mirror's shards and
  fsyncs again; once as shipped and once with ``os.fsync`` made a no-op, to compare like with like;
* host: ``HostWeights.apply_delta`` on a base already loaded in memory (what a replica does), with
  its peak RSS (it holds the whole model);
* CLI in place: ``rollouts snapshot apply BASE DELTA --out BASE``, the whole command timed from
  outside (interpreter start and imports included) on a fresh copy of the base, against cwtrain's
  ``apply_delta`` as shipped (fsync on both; cwtrain's start not counted);
* disk: the new checkpoint's bytes written and fsynced, once as a new file (what a writer of a
  new checkpoint pays) and once over the blocks of an existing file (the least any apply that
  leaves the checkpoint on disk can pay here): the device's floor, beside the ratios it bounds;
* raw: frames and base tensors already in memory, parallel zstd decompress + XOR + Adler-32
  (the same zlib-ng Adler-32 as ours)
  (whole tensors, and in the streamed apply's chunk size: the faster is the limit).

Every figure is the best of ``--repeat`` runs (the page cache is synced before each timed run),
because this is usually measured on a shared machine. Next to each wall-clock figure is the
process's CPU cost (GB per CPU-second, all threads): other load on the machine barely moves it,
so its ratios are what a quiet machine's throughput ratios would be when nothing waits on disk.

    .venv/bin/python bench/delta_apply.py --size-mb 1024     # a 1 GiB model (default)
    .venv/bin/python bench/delta_apply.py --size-mb 128      # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import envs  # noqa: E402
from snapshots.codec import adler32, default_workers, fill_from  # noqa: E402
from snapshots.host import HostWeights  # noqa: E402
from snapshots.inspect import read_delta_plan  # noqa: E402
from snapshots.stream import CHUNK_BYTES  # noqa: E402
from snapshots.synthetic import make_checkpoint_pair  # noqa: E402
from snapshots.writer import DeltaStats, write_delta  # noqa: E402

# ru_maxrss survives fork+exec on Linux (it would report the parent's peak); VmHWM does not.
# cpu(): this process's CPU seconds (all threads), a figure the machine's other load barely moves.
HWM = """
import resource
def hwm_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
"""

STREAM = (
    HWM
    + """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from snapshots.stream import materialize_chain_report
rss0 = hwm_mb()
t, c = time.perf_counter(), cpu()
r = materialize_chain_report(sys.argv[2], [sys.argv[3]], sys.argv[4], fsync=sys.argv[5] == "1")
dt, dc = time.perf_counter() - t, cpu() - c
print(json.dumps({"seconds": dt, "cpu": dc, "bytes_changed": r.bytes_changed,
                  "peak_rss_mb": hwm_mb(), "rss_before_mb": rss0}))
"""
)

HOST = (
    HWM
    + """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from snapshots.host import HostWeights
w = HostWeights.load(sys.argv[2], verify=False)
rss0 = hwm_mb()
t, c = time.perf_counter(), cpu()
r = w.apply_delta_report(sys.argv[3])
dt, dc = time.perf_counter() - t, cpu() - c
print(json.dumps({"seconds": dt, "cpu": dc, "bytes_changed": r.bytes_changed,
                  "peak_rss_mb": hwm_mb(), "rss_before_mb": rss0}))
"""
)

CWTRAIN = (
    HWM
    + """
import json, os, sys, time
from cwtrain.hotload import WeightMirror
m = WeightMirror(sys.argv[1])
if sys.argv[3] == "0":
    os.fsync = lambda fd: None  # the mirror calls os.fsync through the module
rss0 = hwm_mb()
t, c = time.perf_counter(), cpu()
r = m.apply_delta(sys.argv[2])
dt, dc = time.perf_counter() - t, cpu() - c
print(json.dumps({"seconds": dt, "cpu": dc, "bytes_changed": r.bytes_changed,
                  "peak_rss_mb": hwm_mb(), "rss_before_mb": rss0}))
"""
)

MIRROR_CREATE = """
import sys
from cwtrain.hotload import WeightMirror
WeightMirror.create(sys.argv[1], sys.argv[2])
"""


def raw_limit(base: Path, delta: Path, workers: int, chunk_bytes: int) -> list[dict[str, float]]:
    """Parallel zstd decompress + XOR + Adler-32 of every changed tensor, frames and base tensors
    already in memory: once a whole tensor per pass, once in cache-sized chunks (the way the
    streamed apply works). Either may be the faster; the bench takes the best as the limit."""
    weights = HostWeights.load(base)
    plan = read_delta_plan(delta)
    frames = {t.name: plan.source.read_range(t.file, t.begin, t.wire_bytes) for t in plan.tensors.values()}
    targets = {n: weights.raw(n).copy() for n in frames}
    del weights
    local = threading.local()

    def scratch(nbytes: int) -> np.ndarray:
        buf = getattr(local, "s", None)
        if buf is None or buf.nbytes < nbytes:
            buf = local.s = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    def whole(name: str) -> None:
        target = targets[name]
        out = scratch(target.nbytes)
        with zstandard.ZstdDecompressor().stream_reader(frames[name]) as reader:
            fill_from(reader, memoryview(out))
        np.bitwise_xor(target, out, out=target)
        adler32(target)

    def chunked(name: str) -> None:
        target, running = targets[name], adler32(b"")
        with zstandard.ZstdDecompressor().stream_reader(frames[name]) as reader:
            for begin in range(0, target.nbytes, chunk_bytes):
                part = target[begin : begin + chunk_bytes]
                out = scratch(part.nbytes)
                fill_from(reader, memoryview(out))
                np.bitwise_xor(part, out, out=part)
                running = adler32(part, running)

    results = []
    for one in (whole, chunked):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start, cpu = time.perf_counter(), usage.ru_utime + usage.ru_stime
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, frames))
        seconds = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime - cpu
        results.append({"seconds": seconds, "cpu": cpu, "bytes_changed": sum(t.nbytes for t in targets.values())})
    return results


def disk_floor(path: Path, nbytes: int) -> list[dict[str, float]]:
    """Seconds to write ``nbytes`` and fsync them: into a new file, then over that file's blocks."""
    block = np.random.default_rng(0).integers(0, 256, 8 * 2**20, dtype=np.uint8).tobytes()
    results = []
    for flags in (os.O_CREAT | os.O_EXCL, 0):
        os.sync()
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | flags, 0o644)
        try:
            for offset in range(0, nbytes, len(block)):
                os.pwrite(fd, block[: nbytes - offset], offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        results.append({"seconds": time.perf_counter() - start, "cpu": 0.0, "bytes_changed": nbytes})
    path.unlink()
    return results


def run_cli_in_place(rollouts: str, base: Path, delta: Path, work: Path) -> dict[str, Any]:
    """``rollouts snapshot apply WORK DELTA --out WORK`` on a fresh copy of the base, timed from
    outside: what a user waits for, interpreter start included."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run = subprocess.run(
        [rollouts, "snapshot", "apply", str(work), str(delta), "--out", str(work)], capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode:
        raise SystemExit(f"rollouts snapshot apply failed:\n{run.stderr[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    # The same delta as the other runs: its changed bytes are theirs (filled in by main).
    return {
        "seconds": seconds,
        "cpu": cpu,
        "changed_tensors": sum(d["changed"] for d in json.loads(run.stdout)["deltas"]),
    }


def run_json(argv: list[str]) -> dict[str, Any]:
    os.sync()  # start from a clean page cache: no earlier run's write-back competes with this one
    run = subprocess.run(argv, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{argv[0]} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda r: r["seconds"])


Runs = dict[str, list[dict[str, Any]]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best is reported")
    parser.add_argument("--workdir", type=Path, help="where to build the checkpoints (default: a temp dir)")
    parser.add_argument(
        "--cwtrain-python", default=envs.ROLLOUTS_CWTRAIN_PYTHON.get() or str(REPO / ".venv-cw/bin/python")
    )
    return parser.parse_args()


def make_pair(root: Path, size_mb: float) -> tuple[dict[str, Any], DeltaStats]:
    """A synthetic base at `root/base` and its delta at `root/delta` (the new checkpoint removed)."""
    base, delta = root / "base", root / "delta"
    t = time.perf_counter()
    summary = make_checkpoint_pair(base, root / "new", size_mb=size_mb)
    print(
        f"generated {summary['tensor_bytes'] / 1e9:.2f} GB BF16 pair in {time.perf_counter() - t:.0f}s; "
        f"{100 * summary['changed_element_fraction']:.2f}% of elements changed",
        flush=True,
    )
    stats = write_delta(base, root / "new", delta, version="000001", base_version="000000")
    shutil.rmtree(root / "new")
    print(
        f"delta: {stats.changed}/{stats.tensors_total} tensors, {stats.wire_bytes / 1e6:.1f} MB on the wire "
        f"({100 * stats.ratio:.2f}% of full)",
        flush=True,
    )
    return summary, stats


def one_round(args: argparse.Namespace, root: Path, tensor_bytes: int, workers: int, runs: Runs) -> None:
    """Every contender once, interleaved, so a burst of load elsewhere on the machine hits each alike."""
    py = sys.executable
    base, delta, out, mirror = root / "base", root / "delta", root / "out", root / "mirror"
    for fsync in ("0", "1"):
        shutil.rmtree(out, ignore_errors=True)
        runs.setdefault(f"ours fsync={fsync}", []).append(
            run_json([py, "-c", STREAM, str(REPO), str(base), str(delta), str(out), fsync])
        )
    shutil.rmtree(out, ignore_errors=True)
    if Path(args.cwtrain_python).exists():
        for fsync in ("0", "1"):
            subprocess.run(
                [args.cwtrain_python, "-c", MIRROR_CREATE, str(base), str(mirror)],
                check=True,
                capture_output=True,
            )
            runs.setdefault(f"cwtrain fsync={fsync}", []).append(
                run_json([args.cwtrain_python, "-c", CWTRAIN, str(mirror), str(delta), fsync])
            )
        shutil.rmtree(mirror, ignore_errors=True)
    rollouts = str(Path(py).parent / "rollouts")
    runs.setdefault("ours CLI in place", []).append(run_cli_in_place(rollouts, base, delta, root / "work"))
    runs.setdefault("host (in memory)", []).append(run_json([py, "-c", HOST, str(REPO), str(base), str(delta)]))
    runs.setdefault("raw", []).extend(raw_limit(base, delta, workers, CHUNK_BYTES))
    new_file, over_file = disk_floor(root / "disk", tensor_bytes)
    runs.setdefault("disk, new file", []).append(new_file)
    runs.setdefault("disk, overwrite", []).append(over_file)


def best_results(runs: Runs, stats: DeltaStats, model_mb: float) -> dict[str, dict[str, Any]]:
    """Each contender's best run, printed with its throughput and CPU cost."""
    for r in runs["ours CLI in place"]:
        if r["changed_tensors"] != stats.changed:
            raise SystemExit(f"the CLI applied {r['changed_tensors']} changed tensors, the delta has {stats.changed}")
        r["bytes_changed"] = runs["ours fsync=1"][0]["bytes_changed"]
    results = {name: best(r) for name, r in runs.items()}
    for name, r in results.items():
        r["gbps"] = r["bytes_changed"] / r["seconds"] / 1e9
        if name.startswith("disk"):
            print(f"{name:18s} {r['seconds']:7.3f}s  {r['gbps']:6.3f} GB/s written and fsynced")
            continue
        r["gb_per_cpu_s"] = r["bytes_changed"] / min(x["cpu"] for x in runs[name]) / 1e9
        extra = (
            f", peak RSS {r['peak_rss_mb']:.0f} MiB ({100 * r['peak_rss_mb'] / model_mb:.0f}% of the model)"
            if "peak_rss_mb" in r
            else ""
        )
        print(
            f"{name:18s} {r['seconds']:7.3f}s  {r['gbps']:6.3f} GB/s of changed bytes; "
            f"{r['gb_per_cpu_s']:6.3f} GB per CPU-second{extra}"
        )
    return results


def print_ratios(results: dict[str, dict[str, Any]]) -> None:
    print("ratios: by wall-clock throughput (the target); by CPU cost (what a quiet machine would show)")
    for fsync in ("0", "1"):
        if f"cwtrain fsync={fsync}" in results:
            ours, theirs = results[f"ours fsync={fsync}"], results[f"cwtrain fsync={fsync}"]
            print(
                f"ours / cwtrain mirror, fsync={fsync}: {ours['gbps'] / theirs['gbps']:.1f}x; "
                f"{ours['gb_per_cpu_s'] / theirs['gb_per_cpu_s']:.1f}x"
            )
    if "cwtrain fsync=1" in results:
        ours, theirs = results["ours CLI in place"], results["cwtrain fsync=1"]
        print(
            f"ours CLI in place (start included) / cwtrain apply_delta as shipped: "
            f"{theirs['seconds'] / ours['seconds']:.1f}x ({ours['seconds']:.2f} s vs {theirs['seconds']:.2f} s)"
        )
        floor = results["disk, overwrite"]["seconds"]
        print(
            f"the disk's floor: any apply that leaves the checkpoint on disk takes at least {floor:.2f} s here "
            f"(the bytes written over existing blocks and fsynced): at most {theirs['seconds'] / floor:.1f}x "
            f"cwtrain as shipped, before decoding or starting anything"
        )
    raw = results["raw"]
    for name in ("ours fsync=0", "ours fsync=1", "ours CLI in place", "host (in memory)"):
        r = results[name]
        print(
            f"{name} / raw limit: {100 * r['gbps'] / raw['gbps']:.0f}%; "
            f"{100 * r['gb_per_cpu_s'] / raw['gb_per_cpu_s']:.0f}%"
        )


def main() -> None:
    args = parse_args()
    workers = default_workers()
    runs: Runs = {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        summary, stats = make_pair(root, args.size_mb)
        for i in range(args.repeat):
            one_round(args, root, summary["tensor_bytes"], workers, runs)
            print(f"round {i + 1}/{args.repeat} done", flush=True)
    model_mb = summary["tensor_bytes"] / 2**20
    print(f"workers: {workers}; model tensor bytes: {model_mb:.0f} MiB; best of {args.repeat} runs each")
    print_ratios(best_results(runs, stats, model_mb))


if __name__ == "__main__":
    main()
