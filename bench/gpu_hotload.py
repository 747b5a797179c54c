"""Measure: the pause of a hot-load on one device with torch alone (no vLLM, no stack), through the
project's own engine code (`replica.engine.stage`: take -> swap -> commit, the proof, the
roll-back; `replica.engine.scatter` for a delta's changed elements).

The model has vLLM's parameter layout (per layer ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj`` and two norms, fused as vLLM's loader fuses the checkpoint's q/k/v and gate/up) and
an 8B Llama model's shapes (hidden 4096, 32 heads of 128 with 8 for k/v, MLP 14336); ``--layers``
sets how many (32 is the 8B model without its embeddings; the CPU default is 2). Its
``load_weights`` copies each checkpoint tensor into its slice of the fused parameter, so
`weight_map.WeightMap` maps it as it maps a vLLM engine.

It reports, side by side in one run:

- an RL-like delta (``--changed`` of the BF16 elements, 5 % by default) swapped in as the engine
  plans it (`scatter.plan`: each tensor's changed elements scattered, or the tensor whole, as
  the plan chooses) against the same delta swapped in whole (dense, the baseline): the pause
  (swap + proof), the bytes written into the engine inside it, and their ratios;
- a memcpy of the bytes the pause must touch (every byte of the update: the proof reads it all),
  measured in each run beside the swaps (this machine's speed varies with its load), and each
  pause as a multiple of it;
- on the host, what a scattered element costs against copying bytes (the crossover the plan's
  host cost model rests on, `scatter.HOST_SCATTER_ELEMENT_BYTES`);
- a FULL (every element new): the pause and its bytes; on CUDA also a FULL past the device
  budget from pinned host memory (the pause's asynchronous copies) against the same from
  pageable memory (the baseline);
- host -> device copy GB/s from pinned and from pageable memory, against the device's own copy
  rate (device -> device), on CUDA;
- a read-back that fails after a scatter (one element the delta did not change, altered): every
  parameter back to its bytes before the update, bit for bit.

    .venv/bin/python bench/gpu_hotload.py --device cpu            # ~1 minute on 2 cores
    python bench/gpu_hotload.py --device cuda --layers 32         # one GPU, torch only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from replica.engine import scatter  # noqa: E402
from replica.engine.stage import StageSlot, take  # noqa: E402
from replica.engine.tensors import adler32_hex  # noqa: E402
from replica.engine.weight_map import WeightMap  # noqa: E402

BF16 = torch.bfloat16
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 4096, 32, 8, 128, 14336


class Layer(torch.nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=BF16, device=device), requires_grad=False)

        self.qkv_proj = param(q + 2 * kv, HIDDEN)
        self.o_proj = param(HIDDEN, q)
        self.gate_up_proj = param(2 * MLP, HIDDEN)
        self.down_proj = param(HIDDEN, MLP)
        self.input_layernorm = param(HIDDEN)
        self.post_attention_layernorm = param(HIDDEN)


class Model(torch.nn.Module):
    """vLLM's layout for a Llama model's layers; ``load_weights`` takes checkpoint names."""

    def __init__(self, layers: int, device: str) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(device) for _ in range(layers))

    def load_weights(self, weights) -> None:
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        stacked = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q),
            "v_proj": ("qkv_proj", q + kv),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", MLP),
        }
        for name, t in weights:
            index, part = int(name.split(".")[1]), name.split(".")[2]
            layer = self.layers[index]
            if part in stacked:
                fused, start = stacked[part]
                getattr(layer, fused).data[start : start + t.shape[0]].copy_(t)
            else:
                getattr(layer, part).data.copy_(t)


def checkpoint_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "q_proj": (q, HIDDEN),
                p + "k_proj": (kv, HIDDEN),
                p + "v_proj": (kv, HIDDEN),
                p + "o_proj": (HIDDEN, q),
                p + "gate_proj": (MLP, HIDDEN),
                p + "up_proj": (MLP, HIDDEN),
                p + "down_proj": (HIDDEN, MLP),
                p + "input_layernorm": (HIDDEN,),
                p + "post_attention_layernorm": (HIDDEN,),
            }
        )
    return out


def random_checkpoint(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=gen) * 0.02).to(BF16) for n, s in shapes.items()}


def rl_step(old: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """``old`` with about ``fraction`` of every tensor's BF16 elements moved by one ulp or so,
    as one Adam step at an RL learning rate changes them."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in old.items():
        t = t.clone()
        mask = torch.rand(t.shape, generator=gen) < fraction
        t[mask] = (t[mask].float() * 1.01 + 1e-4).to(BF16)
        out[name] = t
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def swap_in(
    wmap: WeightMap,
    label: str,
    tensors: dict[str, torch.Tensor],
    backup: dict[str, torch.Tensor] | None,
    sparse: bool,
    device: str,
) -> tuple[float, dict]:
    """Stage (not timed: the engine serves meanwhile), then the pause: swap + proof. Returns
    (pause seconds, the report)."""
    expected = {n: adler32_hex(t) for n, t in tensors.items()}
    slot = StageSlot()
    slot.put(take(wmap, label, list(tensors.items()), backup, expected, checked=True, sparse=sparse))
    sync(device)
    t0 = time.perf_counter()
    report = slot.swap_and_commit(wmap, label)
    sync(device)
    pause = time.perf_counter() - t0
    if report.get("verified") != len(tensors):
        raise SystemExit(f"{label}: not proven: {report}")
    return pause, report


def every_tensor_scattered(
    wmap: WeightMap, label: str, tensors: dict[str, torch.Tensor], backup: dict[str, torch.Tensor], device: str
) -> tuple[float, dict]:
    """:func:`swap_in` of a delta with every tensor's changed elements scattered (a scattered
    element costing nothing: the host's choice set aside), the form the plan weighs against."""
    chosen = scatter.HOST_SCATTER_ELEMENT_BYTES
    scatter.HOST_SCATTER_ELEMENT_BYTES = 0
    try:
        return swap_in(wmap, label, tensors, backup, True, device)
    finally:
        scatter.HOST_SCATTER_ELEMENT_BYTES = chosen


def memcpy_s(dst: torch.Tensor, src: torch.Tensor, repeats: int = 3) -> float:
    """Median seconds of ``dst.copy_(src)`` (two buffers allocated and touched once, reused)."""
    times = []
    for _ in range(repeats):
        sync(str(dst.device))
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(str(dst.device))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_scatter_cost(fraction: float, size: int = 256 << 20) -> dict[str, float]:
    """On host memory, over a BF16 buffer of ``size`` bytes (past the caches): ns per element of a
    scatter of ``fraction`` of its elements at sorted random offsets (int32 and int64 offsets),
    ns per byte of a copy of the whole buffer, and what one scattered element costs in copied
    bytes (the crossover: scattering wins below width / that fraction of elements changed)."""
    dst = torch.zeros(size // 2, dtype=BF16)
    src = torch.ones(size // 2, dtype=BF16)
    count = int(fraction * dst.numel())
    gen = torch.Generator().manual_seed(0)
    offsets = torch.randperm(dst.numel(), generator=gen)[:count].sort().values
    values = torch.ones(count, dtype=BF16)
    copy_ns_per_byte = memcpy_s(dst, src) * 1e9 / size
    out = {"copy_ns_per_byte": copy_ns_per_byte}
    for dtype in (torch.int32, torch.int64):
        index = offsets.to(dtype)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            dst[index] = values
            times.append(time.perf_counter() - t0)
        ns = statistics.median(times) * 1e9 / count
        out[f"{str(dtype).removeprefix('torch.')}_ns"] = ns
        out[f"{str(dtype).removeprefix('torch.')}_bytes"] = ns / copy_ns_per_byte
    return out


def copy_rates(device: str, size: int) -> dict[str, float]:
    """GB/s host -> device from pageable and pinned memory, and device -> device."""
    if not device.startswith("cuda"):
        return {}
    out = {}
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    for kind, src in (
        ("pageable", torch.ones(size, dtype=torch.uint8)),
        ("pinned", torch.ones(size, dtype=torch.uint8).pin_memory()),
        ("device", torch.ones(size, dtype=torch.uint8, device=device)),
    ):
        times = []
        for _ in range(5):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=kind == "pinned")
            sync(device)
            times.append(time.perf_counter() - t0)
        out[kind] = size / statistics.median(times) / 1e9
    return out


def served(wmap: WeightMap) -> dict[str, str]:
    return {n: adler32_hex(p) for n, p in wmap.model.named_parameters()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--layers", type=int, default=None, help="32: an 8B model's layers (default: 32 on CUDA, 2 on the CPU)"
    )
    parser.add_argument("--changed", type=float, default=0.05, help="fraction of elements a delta changes")
    parser.add_argument("--runs", type=int, default=3)
    return parser.parse_args()


Checkpoint = dict[str, torch.Tensor]
Rows = dict[str, list[tuple[float, dict]]]
MEMCPY = "memcpy"  # the row of a memcpy of the update's bytes, measured beside each run's swaps


def measure_deltas_and_full(
    wmap: WeightMap, base: Checkpoint, shapes: dict[str, tuple[int, ...]], args: argparse.Namespace, device: str
) -> tuple[Rows, Checkpoint]:
    """Each run: a memcpy of the update's bytes, the delta whole and as planned (from the same
    weights); then one FULL. The rows (the memcpy's as ``(seconds, {})``) and the weights served
    at the end."""
    rows: Rows = {
        "delta, as planned": [],
        "delta, all scattered": [],
        "delta, whole (baseline)": [],
        "FULL": [],
        MEMCPY: [],
    }
    size = sum(t.nbytes for t in base.values())
    src, dst = torch.ones(size, dtype=torch.uint8, device=device), torch.zeros(size, dtype=torch.uint8, device=device)
    current = base
    for run in range(args.runs):
        new = rl_step(current, args.changed, seed=run + 1)
        rows[MEMCPY].append((memcpy_s(dst, src), {}))
        # The same delta twice: whole, then back, then as planned (each from the same weights).
        rows["delta, whole (baseline)"].append(swap_in(wmap, f"whole-{run}", new, current, False, device))
        swap_in(wmap, f"back-{run}", current, new, False, device)
        rows["delta, as planned"].append(swap_in(wmap, f"delta-{run}", new, current, True, device))
        swap_in(wmap, f"back-again-{run}", current, new, False, device)
        rows["delta, all scattered"].append(every_tensor_scattered(wmap, f"scattered-{run}", new, current, device))
        current = new
    del src, dst
    full = random_checkpoint(shapes, seed=100)
    rows["FULL"].append(swap_in(wmap, "full", full, None, False, device))
    return rows, full


def measure_full_from_host(
    wmap: WeightMap, base: Checkpoint, full: Checkpoint, runs: int, device: str, rows: Rows
) -> Checkpoint:
    """A FULL past the device budget: from pinned host memory (asynchronous copies on two
    streams) against the same FULL from pageable memory (the baseline), both proven. Returns the
    weights served at the end."""
    current = full
    os.environ[scatter.BUDGET_ENV] = "0"
    for what, pinned in (("FULL, pinned", str(1 << 40)), ("FULL, pageable (baseline)", "0")):
        os.environ[scatter.PINNED_BUDGET_ENV] = pinned
        rows[what] = []
        for run in range(runs):
            current = (base, full)[run % 2]  # a FULL compares nothing: any other weights do
            rows[what].append(swap_in(wmap, f"{what}-{run}", current, None, False, device))
    del os.environ[scatter.BUDGET_ENV], os.environ[scatter.PINNED_BUDGET_ENV]
    return current


def r_changed(what: str) -> bool:
    return what in ("delta, as planned", "delta, all scattered")


def print_medians(rows: Rows) -> dict[str, tuple[float, float, float]]:
    """The table of medians; per update: (pause s, bytes in the pause, write s)."""
    print(
        f"\n{'update':<26} {'pause ms':>9} {'write ms':>9} {'proof ms':>9} {'bytes in the pause':>19} "
        f"{'changed':>11}   (medians)"
    )
    medians = {}
    for what, results in rows.items():
        if what == MEMCPY:
            continue
        pause = statistics.median(p for p, _ in results)
        write = statistics.median(r["copy_s"] + r["repack_s"] for _, r in results)
        prove = statistics.median(r["verify_s"] for _, r in results)
        moved = statistics.median(r["pause_bytes"] for _, r in results)
        changed = [r["changed_bytes"] for _, r in results] if r_changed(what) else []
        medians[what] = (pause, moved, write)
        shown = f"{statistics.median(changed) / 1e6:8.1f} MB" if changed else f"{'—':>11}"
        print(
            f"{what:<26} {1000 * pause:>9.1f} {1000 * write:>9.1f} {1000 * prove:>9.1f} {moved / 1e6:>16.1f} MB {shown}"
        )
    return medians


def than(ours: float, baseline: float) -> str:
    """``ours`` against ``baseline`` in words: "2.00x shorter" (half of it), "1.60x longer"."""
    if ours <= 0 or baseline <= 0:
        return "—"
    return f"{baseline / ours:.2f}x shorter" if ours < baseline else f"{ours / baseline:.2f}x longer"


def print_comparisons(medians: dict[str, tuple[float, float, float]], rows: Rows, device: str) -> None:
    """Each delta against the whole one, each pause against the memcpy of the update's bytes,
    pinned against pageable, and the copy rates."""
    p_dense, b_dense, w_dense = medians["delta, whole (baseline)"]
    print()
    for what, (pause, moved, write) in medians.items():
        if what.startswith("delta") and what != "delta, whole (baseline)":
            print(
                f"{what} vs whole: {b_dense / max(moved, 1):.1f}x fewer bytes inside the pause, the write "
                f"{than(write, w_dense)}, the pause {than(pause, p_dense)}"
            )
    copy = statistics.median(s for s, _ in rows[MEMCPY])
    print(f"memcpy of the update's bytes (the proof reads every one), beside each run: {1000 * copy:.1f} ms (median)")
    for what, (pause, _, _) in medians.items():
        print(f"  {what:<26} pause {1000 * pause:7.1f} ms = {pause / copy:.2f}x the memcpy")

    if "FULL, pinned" in medians:
        (p_pin, _, w_pin), (p_page, _, w_page) = medians["FULL, pinned"], medians["FULL, pageable (baseline)"]
        print(f"FULL from pinned vs pageable memory: the write {than(w_pin, w_page)}, the pause {than(p_pin, p_page)}")

    rates = copy_rates(device, 1 << 30)
    if rates:
        print(
            f"host -> device: pinned {rates['pinned']:.1f} GB/s, pageable {rates['pageable']:.1f} GB/s; "
            f"device -> device {rates['device']:.0f} GB/s"
        )


def print_host_scatter_cost(fraction: float) -> None:
    """What one scattered element costs on host memory, in bytes of a copy (the plan's crossover)."""
    for f in sorted({0.01, 0.03, fraction}):  # 3 %: about where the plan's host crossover falls
        cost = host_scatter_cost(f)
        print(
            f"host scatter of {100 * f:.0f} % of 128 M BF16 elements: int32 offsets {cost['int32_ns']:.1f} ns, "
            f"int64 {cost['int64_ns']:.1f} ns an element; a copy {cost['copy_ns_per_byte']:.3f} ns a byte: one "
            f"scattered element costs what copying {cost['int32_bytes']:.0f} (int32) / {cost['int64_bytes']:.0f} "
            f"(int64) bytes does (the plan takes {scatter.HOST_SCATTER_ELEMENT_BYTES})"
        )


def rollback_is_exact(wmap: WeightMap, current: Checkpoint, changed: float) -> bool:
    """Roll-back: a scattered delta whose read-back fails (an element it did not change, altered)
    leaves the weights served before, exactly."""
    before = served(wmap)
    new = rl_step(current, changed, seed=999)
    expected = {n: adler32_hex(t) for n, t in new.items()}
    slot = StageSlot()
    slot.put(take(wmap, "faulty", list(new.items()), current, expected, checked=True, sparse=True))
    slot.swap(wmap, "faulty")
    name = "layers.0.o_proj"
    same = (new[name].view(torch.int16) == current[name].view(torch.int16)).reshape(-1).nonzero()[0, 0]
    wmap.model.layers[0].o_proj.data.view(-1)[same] += 1
    result = slot.commit(wmap, "faulty")
    exact = result.get("read_back_failed") == [name] and served(wmap) == before
    print(f"roll-back after a failed read-back: {'exact' if exact else 'NOT EXACT'} ({result.get('read_back_failed')})")
    return exact


def main() -> None:
    args = parse_args()
    device = args.device
    layers = args.layers or (32 if device.startswith("cuda") else 2)
    shapes = checkpoint_shapes(layers)
    base = random_checkpoint(shapes, seed=0)
    size = sum(t.nbytes for t in base.values())
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.startswith('cuda') else 'host memory'}), "
        f"{layers} layer(s) of an 8B model's shapes: {len(base)} tensors, {size / 1e9:.2f} GB BF16"
    )
    model = Model(layers, device)
    model.load_weights(base.items())
    wmap = WeightMap.build(model, [(n, tuple(t.shape), t.dtype) for n, t in base.items()], base.__getitem__)

    rows, current = measure_deltas_and_full(wmap, base, shapes, args, device)
    if device.startswith("cuda"):
        current = measure_full_from_host(wmap, base, current, args.runs, device, rows)
    print_comparisons(print_medians(rows), rows, device)
    if not device.startswith("cuda"):
        print_host_scatter_cost(args.changed)
    if not rollback_is_exact(wmap, current, args.changed):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
