"""Benchmark: our ``write_delta`` vs cwtrain's on the same realistic checkpoint pair.

    .venv/bin/python bench/delta_write.py --size-mb 1024
    .venv/bin/python bench/delta_write.py --size-mb 128      # a quick run

Prints time (GB/s of checkpoint) and output size for both writers; targets: no larger, no slower.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import envs  # noqa: E402
from snapshots.synthetic import make_checkpoint_pair  # noqa: E402
from snapshots.writer import write_delta  # noqa: E402

CWTRAIN = """
import json, sys, time
from cwtrain.hotload.delta import write_delta
t = time.perf_counter(); s = write_delta(sys.argv[1], sys.argv[2], sys.argv[3], version='1', base_version='0')
print(json.dumps({"seconds": time.perf_counter() - t, "changed": s.tensors_changed}))
"""


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument(
        "--cwtrain-python", default=envs.ROLLOUTS_CWTRAIN_PYTHON.get() or str(REPO / ".venv-cw/bin/python")
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        summary = make_checkpoint_pair(root / "base", root / "new", size_mb=args.size_mb)
        total = summary["tensor_bytes"]
        t = time.perf_counter()
        stats = write_delta(root / "base", root / "new", root / "ours", version="1", base_version="0")
        ours = time.perf_counter() - t
        print(
            f"ours     {ours:7.3f}s  {total / ours / 1e9:5.2f} GB/s  {dir_size(root / 'ours') / 1e6:8.2f} MB  "
            f"({stats.changed} tensors)"
        )
        if Path(args.cwtrain_python).exists():
            run = subprocess.run(
                [args.cwtrain_python, "-c", CWTRAIN, str(root / "base"), str(root / "new"), str(root / "cw")],
                capture_output=True,
                text=True,
                check=True,
            )
            cw = json.loads(run.stdout.strip().splitlines()[-1])
            print(
                f"cwtrain  {cw['seconds']:7.3f}s  {total / cw['seconds'] / 1e9:5.2f} GB/s  "
                f"{dir_size(root / 'cw') / 1e6:8.2f} MB  ({cw['changed']} tensors)"
            )
            print(
                f"speed ours/cwtrain: {cw['seconds'] / ours:.2f}x; size ours/cwtrain: "
                f"{dir_size(root / 'ours') / dir_size(root / 'cw'):.4f}"
            )


if __name__ == "__main__":
    main()
