"""Benchmark and check: the replica-to-replica broadcast (replica/engine/peer_group.PeerGroup).

    .venv/bin/python bench/peer_broadcast.py [--size-mb 256] [--receivers 3] [--backends gloo,nccl]

One sender and `--receivers` receivers, each its own process, join one group per backend and
pass a Llama-shaped BF16 update of about `--size-mb` MiB exactly as a rolling update does
(`PeerGroup.send` / `PeerGroup.receive`, the packed chunk protocol); every receiver checks every
tensor's Adler-32 against the sender's. Prints per backend the seconds from join to the last
receiver done and the GB/s delivered (bytes x receivers / seconds), and each backend's time as
a ratio of gloo's in the same run.

NCCL runs where CUDA is available: rank r uses GPU r mod the device count. NCCL refuses two
ranks on one GPU ("Duplicate GPU detected"); on a one-GPU machine the script says so and also
runs the NCCL group with a single member, which still checks our group set-up, broadcast and
shutdown against the installed torch/NCCL.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.processes import free_port  # noqa: E402
from replica.engine.peer_group import PeerGroup  # noqa: E402
from replica.engine.stage import StageSlot, take  # noqa: E402
from replica.engine.tensors import adler32_hex, normalize_specs, spec_of  # noqa: E402
from replica.engine.weight_map import WeightMap  # noqa: E402


def _tensors(size_mb: float, device: str) -> list[tuple[str, "object"]]:
    gen = torch.Generator().manual_seed(0)
    hidden = 1024
    per_layer = 12 * hidden * hidden * 2  # q,k,v,o + gate,up,down at 2x hidden (bytes, BF16)
    layers = max(1, int(size_mb * 2**20 // per_layer))
    out = []
    for i in range(layers):
        for name, shape in (
            ("self_attn.q_proj", (hidden, hidden)),
            ("self_attn.k_proj", (hidden, hidden)),
            ("self_attn.v_proj", (hidden, hidden)),
            ("self_attn.o_proj", (hidden, hidden)),
            ("mlp.gate_proj", (2 * hidden, hidden)),
            ("mlp.up_proj", (2 * hidden, hidden)),
            ("mlp.down_proj", (hidden, 2 * hidden)),
        ):
            t = torch.randn(shape, generator=gen).to(torch.bfloat16)
            out.append((f"model.layers.{i}.{name}.weight", t.to(device)))
    return out


def _member(rank: int, world: int, port: int, backend: str, size_mb: float, queue: "mp.Queue") -> None:
    try:
        device = "cpu"
        if backend == "nccl":
            device = f"cuda:{rank % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
        tensors = _tensors(size_mb, device)
        expected = {n: adler32_hex(t) for n, t in tensors}
        specs = normalize_specs([spec_of(n, t) for n, t in tensors])
        group = PeerGroup.create(
            "127.0.0.1", port, rank, world, backend=backend, timeout_s=60, device=torch.device(device)
        )
        group.count_failures(False)  # a barrier: time the transfer, not the members' start-up
        t0 = time.perf_counter()
        try:
            if rank == 0:
                nbytes = group.send(tensors, 0)
                bad: list[str] = []
            else:
                got = group.receive(specs, 0)
                nbytes = sum(t.numel() * t.element_size() for _, t in got)
                bad = [n for n, t in got if adler32_hex(t) != expected[n]]
        finally:
            group.close()
        queue.put((rank, "ok", time.perf_counter() - t0, nbytes, bad))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", 0.0, 0, [f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=3)]))


def run(backend: str, world: int, size_mb: float) -> dict:
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, backend, size_mb, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [r for r in results if r[1] != "ok"]
    if errors:
        return {"backend": backend, "world": world, "error": errors[0][4][0], "detail": errors[0][4][1]}
    bad = [n for r in results for n in r[4]]
    seconds = max(r[2] for r in results)
    received = sum(r[3] for r in results if r[0] != 0)
    return {
        "backend": backend,
        "world": world,
        "seconds": seconds,
        "bytes_per_receiver": results[0][3],
        "gb_per_s": received / seconds / 1e9,
        "checksum_mismatches": bad,
    }


def cuda_apply_check() -> str:
    """The engine's update lifecycle on CUDA parameters: stage (roll-back copy), swap, read-back
    (bit compare and Adler-32 of the served bytes), and the roll-back of a stage discarded after
    its swap; a tensor of the wrong shape is refused at staging."""

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16, device="cuda")

        def load_weights(self, weights):  # vLLM's interface: (checkpoint name, tensor) pairs
            params = dict(self.named_parameters())
            for name, t in weights:
                params[name].data.copy_(t)

    net, slot = Tiny(), StageSlot()
    base = {"proj.weight": net.proj.weight.detach().to("cpu").clone()}
    model = WeightMap.build(net, [(n, tuple(t.shape), t.dtype) for n, t in base.items()], base.__getitem__)
    new = torch.randn(64, 64).to(torch.bfloat16)
    slot.put(take(model, "v1", [("proj.weight", new)]))
    slot.swap(model, "v1")
    assert slot.commit(model, "v1")["verified"] == 1, "the read-back differs after the swap"
    assert adler32_hex(net.proj.weight) == adler32_hex(new), "served bytes differ after the swap"
    before = adler32_hex(net.proj.weight)
    slot.put(take(model, "v2", [("proj.weight", torch.randn(64, 64).to(torch.bfloat16))]))
    slot.swap(model, "v2")
    assert slot.discard(model)["rolled_back"] and adler32_hex(net.proj.weight) == before, "no roll-back"
    try:
        take(model, "v3", [("proj.weight", torch.zeros(3, 3, dtype=torch.bfloat16))])
        raise AssertionError("a wrong shape was staged")
    except ValueError:
        pass
    assert adler32_hex(net.proj.weight) == before, "a refused stage changed the engine"
    return "cuda check: stage, swap, read-back, discard's roll-back, refusal: ok"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=256)
    ap.add_argument("--receivers", type=int, default=3)
    ap.add_argument("--backends", default="gloo,nccl")
    args = ap.parse_args()

    backends = [b for b in args.backends.split(",") if b]
    if "nccl" in backends and not torch.cuda.is_available():
        print("nccl: skipped (no CUDA device)")
        backends.remove("nccl")
    world = 1 + args.receivers
    if torch.cuda.is_available():
        print(cuda_apply_check(), flush=True)
    rows = []
    for backend in backends:
        row = run(backend, world, args.size_mb)
        if "error" in row and backend == "nccl" and torch.cuda.device_count() < world:
            print(f"nccl with {world} ranks on {torch.cuda.device_count()} GPU(s): {row['error']}")
            row = run(backend, 1, args.size_mb)
            row["note"] = "single member (one GPU): set-up, broadcast and shutdown only"
        rows.append(row)
        print(row, flush=True)
    base = next((r for r in rows if r["backend"] == "gloo" and "seconds" in r), None)
    print()
    for r in rows:
        if "seconds" not in r:
            print(f"{r['backend']:5s} FAILED: {r['error']}")
            continue
        ratio = f"{base['seconds'] / r['seconds']:.2f}x gloo's speed" if base and r.get("world") == world else ""
        print(
            f"{r['backend']:5s} world {r['world']}: {r['bytes_per_receiver'] / 2**20:.0f} MiB to each of "
            f"{r['world'] - 1} receiver(s) in {r['seconds']:.3f} s, {r['gb_per_s']:.2f} GB/s delivered, "
            f"{len(r['checksum_mismatches'])} checksum mismatches {ratio} {r.get('note', '')}"
        )
    return 0 if all("seconds" in r and not r["checksum_mismatches"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
