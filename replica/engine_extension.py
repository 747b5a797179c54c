"""rollouts' code inside the vLLM engine: a worker extension for in-place weight loads.

Start vLLM with ``--worker-extension-cls replica.engine_extension.WeightLoaderExtension``; vLLM
mixes this class into its worker class, and with ``VLLM_SERVER_DEV_MODE=1`` each public method
is callable over HTTP::

    POST /collective_rpc {"method": "<name>", "args": [...], "kwargs": {...}}
    -> 200 {"results": [<one JSON value per worker>]}          (one worker at TP=1)

Arguments and results travel as JSON (vLLM turns any result that is not a dict, list or None
into ``str``), so every method takes JSON-able arguments and returns a dict. A method that
raises answers HTTP 500 and changes nothing (see "all-or-nothing" below). Do not pass vLLM's
own ``timeout`` field: when it fires, vLLM's executor stops waiting but the worker still runs
the call and later queues its reply, which then answers the *next* RPC. Bound waits inside
the methods instead (``peer_init(timeout_s=...)``).

Names. Every tensor is named as in the HF checkpoint (``model.layers.0.self_attn.q_proj.weight``),
not as vLLM stores it (``...qkv_proj.weight``, fused). The extension maps each checkpoint name
to a *view* of the engine's parameter: the rows of a fused ``qkv_proj`` / ``gate_up_proj``
belonging to ``q``/``k``/``v`` or ``gate``/``up`` (from the model's ``packed_modules_mapping``
and the layer's ``output_sizes``), and the unpadded rows of a vocab embedding. That holds for
unquantized models at tensor-parallel size 1 whose vLLM module names equal the checkpoint's
(the Llama family); parameters that cannot be mapped are reported under their engine names.

Methods (JSON results, per worker):

- ``engine_pid()`` -> ``{"pid": worker pid, "parent_pid": engine-core pid, "idle_spin_s": the
  busy-poll cap ``replica.vllm_plugin`` set in this process, or None}``.
- ``load_weights_from_files(paths, names=None, verify=True, expected_adler32=None)`` ->
  ``{"loaded": [names], "bytes": n, "read_s": s, "apply_s": s}``: reads the tensors (only
  ``names`` when given, else every tensor in the files) from safetensors files and copies them
  into the engine's parameters in place. ``expected_adler32`` (name -> 8 hex digits) is checked
  on the bytes read, before anything changes.
- ``weight_checksums(names=None, algorithm="adler32")`` -> ``{"algorithm": "adler32",
  "checksums": {checkpoint name: hex}, "engine_checksums": {engine name: hex}}``: the digest of
  the bytes the engine holds for each tensor (Adler-32 as 8 hex digits, the snapshot format's
  checksum, or ``"sha256"``). With a BF16 engine and a BF16 checkpoint these equal the digests of
  the checkpoint tensors' raw bytes. ``engine_checksums`` holds parameters with no checkpoint name
  (empty for Llama).
- ``weight_specs(names=None)`` -> ``{"specs": [[name, dtype, shape], ...]}`` (dtype as
  ``"bfloat16"``), in the order ``peer_send`` sends them.
- ``save_weights(names, path)`` -> ``{"saved": [names], "bytes": n, "path": path}``: writes what
  the engine holds for ``names`` (all when None) to a safetensors file (atomically renamed).
- ``peer_init(host, port, rank, world_size, backend="gloo", timeout_s=300)`` ->
  ``{"rank", "world_size", "backend"}``; ``peer_send(names=None, paths=None, src=0)`` ->
  ``{"sent": [names], "bytes": n, "seconds": s}``; ``peer_receive(specs, src=0, verify=True,
  expected_adler32=None)`` -> the ``load_weights_from_files`` shape plus ``"recv_s"``;
  ``peer_close()`` -> ``{"closed": bool}``. ``src`` is the sending rank (any rank may send).
  Every member of the group must call ``peer_init`` concurrently, then the sender ``peer_send``
  and every receiver ``peer_receive`` with the same tensors in the same order (each call blocks
  the engine until all members have joined). Groups are torch's own gloo or NCCL backends over a
  TCP rendezvous (``stateless_group``); gloo is tested on CPU engines here.

Staged updates (the rolling update's fast path). An RPC runs inside the engine core's loop, so a
long one stalls generation as surely as a pause. The expensive parts of an update therefore run
on a background thread of the worker while the engine keeps serving, and only the swap itself
runs inside the pause:

- ``stage_from_files(label, paths, names, expected_adler32)``: read the tensors, check their
  Adler-32, copy aside the engine's current values of the same tensors (the roll-back copy);
- ``stage_from_arena(label, path, entries, expected_adler32)``: the same for tensors the
  replica's agent decoded into shared memory (``replica.stage_arena``; ``entries`` are ``[name,
  dtype, shape, byte offset]``): zero-copy views of that memory, each checked against
  ``expected_adler32``; the commit then also proves the swapped tensors' Adler-32 (below);
- ``peer_stage_send(host, port, world_size, names, backend, timeout_s)``: join a group as rank 0
  and broadcast what this engine holds for ``names`` to every other member;
- ``peer_stage_receive(label, host, port, rank, world_size, specs, expected_adler32, save_path,
  backend, timeout_s)``: join as ``rank``, receive, check the sender's Adler-32, write the bytes
  to ``save_path`` (a safetensors file the replica's host copy takes them from), stage them;
- ``peer_send_files(host, port, world_size, paths, backend, timeout_s)`` /
  ``peer_receive_files(host, port, rank, world_size, specs, expected_adler32, out_dir, backend,
  timeout_s)``: the same broadcast for whole files (a delta link's XOR+zstd files, a few percent
  of the changed tensors' bytes), checked by Adler-32 and written to ``out_dir``;
- ``checksum_job(names)``: Adler-32 of what the engine serves (the served-weights proof);
- ``job_status()`` -> ``{"kind", "state": "idle"|"running"|"done"|"failed", "result", "error"}``
  (one job at a time; starting another while one runs is refused). Each method that starts a
  job answers ``{"kind", "state": "running", "result_path"}``: the job's final status is written
  there as JSON, so a caller on the same host waits on that file rather than polling (each RPC
  keeps vLLM's worker busy-polling for a second, see ``_Job``);
- ``commit_staged(label)`` (inside a pause): load the staged tensors in place, all or nothing,
  and prove them before the pause ends: every stage keeps the expected Adler-32 it was given
  (the snapshot's), and the commit reads back what the engine now holds against them (returned
  as ``checksums`` and counted as ``verified``: the served-weights proof, taken before a single
  token is served on them); a stage without expected checksums is bit-compared with what it was
  given. Any difference rolls the engine's tensors back and fails the commit.
  ``discard_staged()`` drops a stage. A stage is refused at commit if the engine's weights
  changed after it was taken (its roll-back copy would be stale).

All-or-nothing: before touching the engine (at staging, for a staged update), a load checks
that every name maps to an engine tensor of exactly the same shape and dtype (a conversion
would serve bytes other than the snapshot's); it then copies the old values of exactly those
tensors aside, loads, and (``verify``) reads back what the engine now holds. Any failure
restores the old values and raises, so the engine serves exactly what it served before.

CPU engines. vLLM's CPU backend repacks every linear weight into a kernel-private copy after
loading (oneDNN or the AMX "sgl" kernels) and then replaces the parameter with an empty tensor
(``dispatch_cpu_unquantized_gemm(remove_weight=True)``). That makes ``model.load_weights`` fail
for linear layers and makes in-place changes to ``lm_head`` (which keeps its parameter) silently
ineffective, and vLLM's ``/weight_checker`` hashes empty tensors. Importing this module inside
the worker (which vLLM does before it loads the model) therefore patches the dispatch to keep
the parameter, and every load re-runs the dispatch for the layers it touched, so the kernel's
packed copy is rebuilt from the new weights. Cost: linear weights are held twice in CPU memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("rollouts.engine_extension")

# Buffers some checkpoints carry that vLLM computes itself: skipped when a load takes every
# tensor of a file (names=None).
_SKIP_NAMES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "f64": torch.float64,
    "int8": torch.int8,
    "i8": torch.int8,
    "uint8": torch.uint8,
    "u8": torch.uint8,
    "int32": torch.int32,
    "i32": torch.int32,
    "int64": torch.int64,
    "i64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "f8_e4m3": torch.float8_e4m3fn,
}

# One packed broadcast per this many bytes: few collective calls, bounded extra memory.
PEER_CHUNK_BYTES = 256 * 1024 * 1024


def dtype_from_str(name: str) -> torch.dtype:
    key = name.lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}")
    return _DTYPES[key]


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (row-major), as safetensors stores them."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def adler32_hex(t: torch.Tensor) -> str:
    """Adler-32 of the tensor's raw bytes, 8 lowercase hex digits (the snapshot format's)."""
    from snapshots.codec import adler32  # zlib-ng's SIMD one when installed

    return "%08x" % (adler32(tensor_bytes(t)) & 0xFFFFFFFF)


def sha256_hex(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


_ALGORITHMS = {"adler32": adler32_hex, "sha256": sha256_hex}


# ---------------------------------------------------------------------------------------------
# Peer transfer protocol (usable outside vLLM too: a test or trainer process can take part).


def spec_of(name: str, t: torch.Tensor) -> list[Any]:
    return [name, dtype_to_str(t.dtype), list(t.shape)]


def normalize_specs(specs: Iterable[Sequence[Any]]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    out = []
    for spec in specs:
        name, dtype, shape = spec
        out.append((str(name), dtype_from_str(str(dtype)), tuple(int(s) for s in shape)))
    return out


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _chunks(sizes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Group consecutive indices so each group holds at most ``chunk_bytes`` (or one tensor)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    acc = 0
    for i, size in enumerate(sizes):
        if cur and acc + size > chunk_bytes:
            groups.append(cur)
            cur, acc = [], 0
        cur.append(i)
        acc += size
    if cur:
        groups.append(cur)
    return groups


def _spec_digest(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    text = json.dumps([[n, dtype_to_str(d), list(s)] for n, d, s in specs])
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def stateless_group(
    host: str, port: int, rank: int, world_size: int, backend: str, timeout: Any, external_store: bool = False
) -> Any:
    """A gloo or NCCL process group of ``world_size`` members that meet at ``host:port`` (rank
    0 hosts the rendezvous store, unless ``external_store``: another process already does),
    outside torch.distributed's global state, so an engine that already has its own groups
    (vLLM's) can join any number of these, one after another."""
    from torch.distributed import PrefixStore, TCPStore

    master = rank == 0 and not external_store
    store = TCPStore(host, port, world_size, is_master=master, timeout=timeout, wait_for_workers=False)
    prefixed = PrefixStore(f"rollouts-peer/{host}:{port}", store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        return _Owning(ProcessGroupGloo(prefixed, rank, world_size, timeout), store)
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return _Owning(ProcessGroupNCCL(prefixed, rank, world_size, options), store)


class _Owning:
    """A backend process group that keeps its rendezvous store alive as long as it lives."""

    def __init__(self, backend: Any, store: Any) -> None:
        self.backend, self.store = backend, store

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self.backend.broadcast(tensors, opts)

    def allreduce(self, tensors: list[torch.Tensor]) -> Any:
        return self.backend.allreduce(tensors)

    def shutdown(self) -> None:
        if hasattr(self.backend, "shutdown"):
            self.backend.shutdown()
        self.backend = self.store = None


@dataclass
class PeerGroup:
    """A two-or-more-member group for broadcasting weights: gloo (CPU) or NCCL (CUDA)."""

    backend: str
    rank: int
    world_size: int
    group: Any  # a stateless_group
    device: torch.device

    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        device: torch.device | None = None,
        external_store: bool = False,
    ) -> PeerGroup:
        from datetime import timedelta

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown peer backend {backend!r} (gloo or nccl)")
        if backend == "nccl":
            dev = device or torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        group = stateless_group(host, int(port), int(rank), int(world_size), backend, timedelta(seconds=timeout_s),
                                external_store)
        return cls(backend, int(rank), int(world_size), group, dev)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        # The backend's own broadcast: torch.distributed.broadcast maps ranks through the global
        # group, which a stateless group is not part of.
        self.group.broadcast([t], opts).wait()
        if self.backend == "nccl":
            torch.cuda.current_stream(self.device).synchronize()

    def count_failures(self, failed: bool) -> int:
        """How many members report a failure (a sum over the group; every member must call)."""
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64, device=self.device)
        self.group.allreduce([flag]).wait()
        return int(flag.item())  # .item() waits for the device on CUDA

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()

    # The wire protocol: the sender broadcasts an int64 header [count, crc32(specs)]; each
    # member says whether it agrees (an all-reduce of failure flags), so a receiver whose specs
    # differ from the sender's makes every member fail at once instead of misreading bytes or
    # leaving the sender blocked; then the tensors' bytes follow, packed into uint8 chunks of at
    # most PEER_CHUNK_BYTES, in spec order. After a failure mid-stream, close the group.

    def send(
        self,
        tensors: list[tuple[str, torch.Tensor]],
        src: int,
        chunk_bytes: int = PEER_CHUNK_BYTES,
    ) -> int:
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors]
        header = torch.tensor([len(specs), _spec_digest(specs)], dtype=torch.int64, device=self.device)
        self.broadcast(header, src)
        if self.count_failures(False):
            raise ValueError("a receiver rejected the transfer: its specs (names, dtypes, shapes, order) differ")
        sizes = [_nbytes(d, s) for _, d, s in specs]
        total = 0
        for group in _chunks(sizes, chunk_bytes):
            buf = torch.empty(sum(sizes[i] for i in group), dtype=torch.uint8, device=self.device)
            off = 0
            for i in group:
                src_t = tensors[i][1].detach().to(self.device).contiguous().reshape(-1)
                buf[off : off + sizes[i]].copy_(src_t.view(torch.uint8))
                off += sizes[i]
            self.broadcast(buf, src)
            total += buf.numel()
        return total

    def receive(
        self,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        src: int,
        chunk_bytes: int = PEER_CHUNK_BYTES,
    ) -> list[tuple[str, torch.Tensor]]:
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.broadcast(header, src)
        want = [len(specs), _spec_digest(specs)]
        agreed = header.tolist() == want
        if self.count_failures(not agreed) and agreed:
            raise ValueError("another receiver rejected the transfer (its specs differ)")
        if not agreed:
            raise ValueError(
                f"peer sent {int(header[0])} tensors with spec digest {int(header[1])}, "
                f"this receiver expected {want[0]} with digest {want[1]}: the two sides disagree "
                "on names, dtypes, shapes or order"
            )
        sizes = [_nbytes(d, s) for _, d, s in specs]
        out: list[tuple[str, torch.Tensor]] = []
        for group in _chunks(sizes, chunk_bytes):
            buf = torch.empty(sum(sizes[i] for i in group), dtype=torch.uint8, device=self.device)
            self.broadcast(buf, src)
            off = 0
            for i in group:
                name, dtype, shape = specs[i]
                out.append((name, buf[off : off + sizes[i]].view(dtype).reshape(shape)))
                off += sizes[i]
        return out


# ---------------------------------------------------------------------------------------------
# CPU: keep linear weights as parameters (see the module docstring).


def _install_cpu_gemm_patch() -> None:
    try:
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.platforms import current_platform
    except Exception:  # pragma: no cover - vLLM absent: nothing to patch
        return
    if not current_platform.is_cpu():
        return
    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_rollouts_keeps_weight", False):
        return

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        # vLLM's linear.py / vocab_parallel_embedding.py import this name at call time, so
        # replacing the module attribute reaches every layer loaded after this import.
        original(layer, remove_weight=False)

    dispatch_keeping_weight._rollouts_keeps_weight = True  # type: ignore[attr-defined]
    dispatch_keeping_weight._rollouts_original = original  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


# Only inside a vLLM process (the worker imports this module before it loads the model); a
# plain `import replica.engine_extension` elsewhere (tests, trainers) does not pull vLLM in.
if "vllm" in sys.modules:
    _install_cpu_gemm_patch()


def _redispatch_cpu_gemm(module: torch.nn.Module) -> None:
    """Rebuild a CPU layer's packed kernel copy from its (just updated) weight parameter."""
    if not hasattr(module, "cpu_linear"):
        return
    from vllm.model_executor.layers import utils as layer_utils

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    dispatch = getattr(dispatch, "_rollouts_original", dispatch)
    dispatch(module, remove_weight=False)


@dataclass
class _View:
    name: str  # checkpoint name
    engine_name: str  # the vLLM parameter it lives in
    module: torch.nn.Module  # the layer owning that parameter
    tensor: torch.Tensor  # a view into the parameter's storage


def _checkpoint_views(model: torch.nn.Module) -> tuple[dict[str, _View], dict[str, torch.Tensor]]:
    """Map checkpoint names to views of the engine's parameters.

    Returns (views by checkpoint name, engine parameters that could not be mapped).
    """
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    modules = dict(model.named_modules())
    views: dict[str, _View] = {}
    unmapped: dict[str, torch.Tensor] = {}
    for engine_name, param in model.named_parameters():
        mod_name, _, attr = engine_name.rpartition(".")
        module = modules[mod_name]
        parent, _, leaf = mod_name.rpartition(".")
        tp = int(getattr(module, "tp_size", 1) or 1)
        data = param.data
        if data.numel() == 0 and data.dim() == 1:
            # A CPU layer whose weight vLLM dropped (patch not active): nothing to read.
            unmapped[engine_name] = data
            continue
        subs = packed.get(leaf)
        sizes = getattr(module, "output_sizes", None)
        if subs and sizes is not None and len(subs) == len(sizes) and tp == 1:
            dim = int(getattr(param, "output_dim", 0) or 0)
            if sum(sizes) == data.shape[dim]:
                off = 0
                for sub, size in zip(subs, sizes):
                    ck = f"{parent}.{sub}.{attr}" if parent else f"{sub}.{attr}"
                    views[ck] = _View(ck, engine_name, module, data.narrow(dim, off, size))
                    off += size
                continue
        if subs:
            unmapped[engine_name] = data
            continue
        org = getattr(module, "org_vocab_size", None)
        if org is not None and tp == 1 and data.dim() >= 1 and data.shape[0] > org:
            data = data[:org]  # vocab padding rows are not in the checkpoint
        views[engine_name] = _View(engine_name, engine_name, module, data)
    return views, unmapped


def _read_safetensors(paths: Sequence[str], names: Sequence[str] | None) -> list[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    wanted = None if names is None else set(names)
    found: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if wanted is not None and key not in wanted:
                    continue
                if wanted is None and key.endswith(_SKIP_NAMES):
                    continue
                if key in found:
                    raise ValueError(f"tensor {key} appears in more than one file")
                found[key] = f.get_tensor(key)
    if wanted is not None:
        missing = sorted(wanted - found.keys())
        if missing:
            raise ValueError(f"{len(missing)} tensor(s) not found in {list(paths)}: {missing[:8]}")
        return [(n, found[n]) for n in names]  # the caller's order
    return list(found.items())


def _check_expected(tensors: list[tuple[str, torch.Tensor]], expected: dict[str, str] | None) -> None:
    """Compare each tensor's Adler-32 with ``expected`` (name -> 8 hex digits) before any change."""
    if not expected:
        return
    have = dict(tensors)
    missing = sorted(set(expected) - have.keys())
    bad = [
        f"{n}: adler32 {adler32_hex(t)} != expected {expected[n].lower()}"
        for n, t in tensors
        if n in expected and adler32_hex(t) != expected[n].lower()
    ]
    if missing or bad:
        raise ValueError(
            "checksum check failed, nothing loaded: "
            + "; ".join(bad[:8] + [f"{n}: expected but not given" for n in missing[:8]])
        )


def check_loadable(model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, _View]:
    """Refuse (ValueError, naming each tensor) what cannot load in place byte for byte: unknown
    names, duplicates, a shape or a dtype other than the engine parameter's. Returns the
    engine's views by checkpoint name."""
    views, _ = _checkpoint_views(model)
    problems = []
    seen: set[str] = set()
    for name, t in tensors:
        v = views.get(name)
        if name in seen:
            problems.append(f"{name}: given twice")
        elif v is None:
            problems.append(f"{name}: no such tensor in the engine")
        elif tuple(t.shape) != tuple(v.tensor.shape):
            problems.append(f"{name}: shape {tuple(t.shape)} != engine {tuple(v.tensor.shape)}")
        elif t.dtype != v.tensor.dtype:
            # A conversion would serve other bytes than the snapshot's (and its checksums).
            problems.append(f"{name}: dtype {dtype_to_str(t.dtype)} != engine {dtype_to_str(v.tensor.dtype)}")
        seen.add(name)
    if problems:
        raise ValueError(f"refusing to load ({len(problems)} problem(s)): " + "; ".join(problems[:8]))
    return views


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` holds exactly ``b``'s bytes (same dtype and shape; no conversion)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    b = b.to(a.device)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _proof(views: dict[str, _View], tensors: list[tuple[str, torch.Tensor]],
           expected_adler32: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """Read back what the engine holds for ``tensors`` after a load: returns (tensors that
    differ, Adler-32 of each proven tensor).

    With ``expected_adler32`` covering every tensor (the snapshot's checksums), each tensor is
    proven against it: by the Adler-32 of the engine's own bytes when they live in host memory,
    else by the Adler-32 of the bytes given plus a bit compare of the engine's copy with them.
    Without it, the engine's bytes are bit-compared with the bytes given."""
    if not (expected_adler32 and all(n in expected_adler32 for n, _ in tensors)):
        return [n for n, t in tensors if not _same_bits(views[n].tensor, t)], {}
    held: dict[str, str] = {}
    bad: list[str] = []
    for n, t in tensors:
        want = expected_adler32[n].lower()
        engine_t = views[n].tensor
        if engine_t.device.type == "cpu":
            ok = engine_t.dtype == t.dtype and adler32_hex(engine_t) == want
        else:
            ok = adler32_hex(t) == want and _same_bits(engine_t, t)
        if ok:
            held[n] = want
        else:
            bad.append(n)
    return bad, held


def apply_weights(
    model: torch.nn.Module,
    tensors: list[tuple[str, torch.Tensor]],
    verify: bool = True,
    backup: dict[str, torch.Tensor] | None = None,
    expected_adler32: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Load checkpoint-named tensors into ``model`` in place, all or nothing (module docstring).

    ``backup`` (name -> the engine's current values, taken earlier by a stage) saves copying
    them here, inside the pause. ``verify`` reads back what the engine holds afterwards
    (`_proof`: against ``expected_adler32`` when it covers every tensor, returned as
    ``checksums``; else bit for bit against the bytes given) and counts the tensors proven as
    ``verified``; any difference restores the previous values and raises."""
    t0 = time.perf_counter()
    views = check_loadable(model, tensors)
    touched = {id(views[n].module): views[n].module for n, _ in tensors}
    if backup is None:
        backup = {n: views[n].tensor.clone() for n, _ in tensors}
    timings: dict[str, Any] = {}
    try:
        with torch.no_grad():
            t1 = time.perf_counter()
            model.load_weights(iter(tensors))  # type: ignore[operator]
            t2 = time.perf_counter()
            for module in touched.values():
                _redispatch_cpu_gemm(module)
            t3 = time.perf_counter()
            timings = {"copy_s": round(t2 - t1, 6), "repack_s": round(t3 - t2, 6)}
            if verify:
                # Re-resolve: a loader may legitimately have replaced a parameter object.
                views, _ = _checkpoint_views(model)
                missing = [n for n, _ in tensors if n not in views]
                if missing:
                    raise RuntimeError(f"engine lost tensor(s) in the load: {missing[:8]}")
                bad, held = _proof(views, tensors, expected_adler32)
                if held:
                    timings["checksums"] = held  # type: ignore[assignment]
                if bad:
                    raise RuntimeError(f"engine holds different values after the load for {bad[:8]}")
                timings["verified"] = len(tensors)  # type: ignore[assignment]
                timings["verify_s"] = round(time.perf_counter() - t3, 6)
    except BaseException:
        logger.exception("weight load failed; restoring the previous values")
        with torch.no_grad():
            views, _ = _checkpoint_views(model)
            for n, old in backup.items():
                views[n].tensor.copy_(old)
            for module in touched.values():
                _redispatch_cpu_gemm(module)
        raise
    return {
        "loaded": [n for n, _ in tensors],
        "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
        "apply_s": round(time.perf_counter() - t0, 6),
        **timings,
    }


def _select_views(model: torch.nn.Module, names: Sequence[str] | None) -> list[tuple[str, torch.Tensor]]:
    views, _ = _checkpoint_views(model)
    order = list(views) if names is None else list(names)
    missing = [n for n in order if n not in views]
    if missing:
        raise ValueError(f"no such tensor(s) in the engine: {missing[:8]}")
    return [(n, views[n].tensor) for n in order]


@dataclass
class _Staged:
    """Tensors checked and ready to swap in, with the engine's current values of the same
    tensors (the roll-back copy) and the weights generation they were taken at."""

    label: str
    tensors: list[tuple[str, torch.Tensor]]
    backup: dict[str, torch.Tensor]
    generation: int
    expected_adler32: dict[str, str] | None = None  # checked again after the swap


class _Job:
    """One background job of the worker (module docstring, "Staged updates").

    Its final status is also written to ``result_path`` (JSON, atomically), so the caller can
    wait on a file instead of polling ``job_status``: every RPC makes vLLM's worker busy-poll
    its message queue for a second afterwards (``shm_broadcast``'s spin), and a 20 ms poll kept
    every worker of a host spinning, starving the very jobs being waited on of CPU and GIL."""

    def __init__(self, kind: str, fn: Any, result_path: str | None = None) -> None:
        import threading

        self.kind = kind
        self.state = "running"
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.result_path = result_path
        self.started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"rollouts-{kind}", daemon=True)
        self._thread.start()

    def _run(self, fn: Any) -> None:
        try:
            result = fn()
            result["seconds"] = round(time.perf_counter() - self.started, 6)
            self.result, self.state = result, "done"
        except BaseException as exc:  # noqa: BLE001 - reported through job_status
            logger.exception("background %s failed", self.kind)
            self.error, self.state = f"{type(exc).__name__}: {exc}", "failed"
        if self.result_path:
            try:
                tmp = f"{self.result_path}.tmp"
                with open(tmp, "w") as f:
                    json.dump(self.status(), f)
                os.replace(tmp, self.result_path)
            except Exception:  # noqa: BLE001 - job_status still answers
                logger.exception("could not write %s", self.result_path)

    def status(self) -> dict[str, Any]:
        return {"kind": self.kind, "state": self.state, "result": self.result, "error": self.error}


_JOB_SEQ = iter(range(1, 1 << 62))


def _job_result_path(kind: str) -> str:
    import tempfile

    directory = os.environ.get("ROLLOUTS_JOB_DIR") or os.path.join(tempfile.gettempdir(), f"rollouts-jobs-{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{next(_JOB_SEQ)}-{kind}.json")


# The roll-back copies of the current stage live in one host buffer kept across updates: a
# fresh allocation of a model's size costs several times the copy itself in page faults (and
# several engines faulting at once on a small host stretched a 0.15 s copy past a second).
# Host memory even for a GPU engine: a whole model's copy does not fit beside its weights and
# KV cache on the device. The lock keeps a stage from refilling it while a commit may still
# roll back from it.
_BACKUP_POOL: torch.Tensor | None = None
_BACKUP_LOCK = threading.Lock()
_ALIGN = 64


def _backup_copies(views: dict[str, _View], names: list[str]) -> dict[str, torch.Tensor]:
    global _BACKUP_POOL
    sizes = [views[n].tensor.numel() * views[n].tensor.element_size() for n in names]
    total = sum(-(-size // _ALIGN) * _ALIGN for size in sizes)
    if _BACKUP_POOL is None or _BACKUP_POOL.numel() < total:
        _BACKUP_POOL = None  # let the old one go before the new one is allocated
        _BACKUP_POOL = torch.empty(max(total, _ALIGN), dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, size in zip(names, sizes):
        src = views[name].tensor
        dst = _BACKUP_POOL[offset : offset + size].view(src.dtype).reshape(src.shape)
        dst.copy_(src.detach())
        out[name] = dst
        offset += -(-size // _ALIGN) * _ALIGN
    return out


def _stage(
    model: torch.nn.Module, label: str, tensors: list[tuple[str, torch.Tensor]], generation: int,
    backup: dict[str, torch.Tensor] | None = None, expected_adler32: dict[str, str] | None = None,
) -> _Staged:
    """Check that `tensors` load into `model` and keep them with their roll-back copies (the
    given `backup`, views of bytes equal to what the engine serves, else copies taken now) and
    the Adler-32 the commit proves them against (`expected_adler32`)."""
    views = check_loadable(model, tensors)
    if backup is None:
        with _BACKUP_LOCK:
            backup = _backup_copies(views, [n for n, _ in tensors])
    expected = None if expected_adler32 is None else {n: c.lower() for n, c in expected_adler32.items()}
    return _Staged(label, tensors, backup, generation, expected)


_SHARED_MAPS: dict[str, tuple[tuple[int, int, int], Any, torch.Tensor]] = {}


def _map_shared(path: str) -> torch.Tensor:
    """The file at ``path`` mapped shared, as a flat uint8 tensor; the mapping is kept for the
    next stage while the path names the same file (device, inode, size)."""
    import mmap

    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size)
    cached = _SHARED_MAPS.get(path)
    if cached is not None and cached[0] == key:
        return cached[2]
    # Forget mappings of files the agent has let go (a replaced host copy, a grown arena): kept,
    # they would pin that shared memory for the engine's lifetime. Tensors still viewing one
    # (a stage's) keep it alive until they go.
    for other, (other_key, _, _) in list(_SHARED_MAPS.items()):
        try:
            now = os.stat(other)
            gone = (now.st_dev, now.st_ino, now.st_size) != other_key
        except OSError:
            gone = True
        if gone or other == path:
            del _SHARED_MAPS[other]
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    memory = torch.frombuffer(mapped, dtype=torch.uint8)
    _SHARED_MAPS[path] = (key, mapped, memory)
    return memory


def _view_at(memory: torch.Tensor, name: str, offset: int, dtype: torch.dtype, shape: tuple[int, ...],
             where: str) -> torch.Tensor:
    """``name``'s bytes at ``offset`` of a mapped file (`_map_shared`; ``where``: what it holds),
    as a tensor; ValueError naming the tensor if they do not lie inside it."""
    nbytes = _nbytes(dtype, shape)
    if offset < 0 or offset + nbytes > memory.numel():
        raise ValueError(f"{name}: bytes {offset}..{offset + nbytes} lie outside the {memory.numel()}-byte {where}")
    return memory[offset : offset + nbytes].view(dtype).reshape(shape)


def _read_file_tensor(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _save_tensors(tensors: list[tuple[str, torch.Tensor]], path: str) -> None:
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({n: t.contiguous() for n, t in tensors}, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)  # readers never see a half-written file


class WeightLoaderExtension:
    """Mixed into vLLM's worker class; see the module docstring for the contract.

    Every attribute here becomes a worker attribute (vLLM asserts there is no clash) and every
    callable one an RPC method, so helpers live at module level and the only state is
    ``_rollouts_peer``.
    """

    _rollouts_peer: PeerGroup | None = None
    _rollouts_job: _Job | None = None
    _rollouts_staged: _Staged | None = None
    # Bumped by every change of the engine's weights: a stage taken before one is stale.
    _rollouts_generation: int = 0

    def engine_pid(self) -> dict[str, Any]:
        from replica.vllm_plugin import idle_spin_cap, logprob_ranks_eager

        return {"pid": os.getpid(), "parent_pid": os.getppid(), "idle_spin_s": idle_spin_cap(),
                "logprob_ranks_eager": logprob_ranks_eager()}

    def load_weights_from_files(
        self,
        paths: list[str],
        names: list[str] | None = None,
        verify: bool = True,
        expected_adler32: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        tensors = _read_safetensors(paths, names)
        _check_expected(tensors, expected_adler32)
        read_s = time.perf_counter() - t0
        self._rollouts_generation += 1
        result = apply_weights(self.model_runner.model, tensors, verify=verify)  # type: ignore[attr-defined]
        result["read_s"] = round(read_s, 6)
        return result

    def weight_checksums(self, names: list[str] | None = None, algorithm: str = "adler32") -> dict[str, Any]:
        if algorithm not in _ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}: one of {sorted(_ALGORITHMS)}")
        digest = _ALGORITHMS[algorithm]
        model = self.model_runner.model  # type: ignore[attr-defined]
        _, unmapped = _checkpoint_views(model)
        return {
            "algorithm": algorithm,
            "checksums": {n: digest(t) for n, t in _select_views(model, names)},
            "engine_checksums": {} if names is not None else {n: digest(t) for n, t in unmapped.items()},
        }

    def save_weights(self, names: list[str] | None, path: str) -> dict[str, Any]:
        """Write what the engine holds for ``names`` (all when None) to a safetensors file at
        ``path``, by checkpoint name (e.g. to refresh a host copy after a peer transfer)."""
        from safetensors.torch import save_file

        tensors = {n: t.detach().to("cpu").contiguous() for n, t in _select_views(self.model_runner.model, names)}  # type: ignore[attr-defined]
        tmp = f"{path}.tmp-{os.getpid()}"
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)  # readers never see a half-written file
        return {"saved": list(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "path": path}

    def weight_specs(self, names: list[str] | None = None) -> dict[str, Any]:
        return {"specs": [spec_of(n, t) for n, t in _select_views(self.model_runner.model, names)]}  # type: ignore[attr-defined]

    def peer_init(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> dict[str, Any]:
        if self._rollouts_peer is not None:
            raise RuntimeError("a peer group is already open; call peer_close first")
        device = getattr(self, "device", None) if backend == "nccl" else None
        self._rollouts_peer = PeerGroup.create(
            host, port, rank, world_size, backend=backend, timeout_s=timeout_s, device=device
        )
        return {"rank": int(rank), "world_size": int(world_size), "backend": backend}

    def peer_send(
        self, names: list[str] | None = None, paths: list[str] | None = None, src: int = 0
    ) -> dict[str, Any]:
        """Broadcast tensors from this engine (``paths`` None) or from files (``paths``)."""
        group = self._rollouts_peer
        if group is None:
            raise RuntimeError("no peer group: call peer_init first")
        if group.rank != src:
            raise ValueError(f"peer_send on rank {group.rank}, but src is {src}")
        t0 = time.perf_counter()
        if paths is not None:
            tensors = _read_safetensors(paths, names)
        else:
            tensors = _select_views(self.model_runner.model, names)  # type: ignore[attr-defined]
        sent = group.send(tensors, src)
        return {"sent": [n for n, _ in tensors], "bytes": sent, "seconds": round(time.perf_counter() - t0, 6)}

    def peer_receive(
        self,
        specs: list[list[Any]],
        src: int = 0,
        verify: bool = True,
        expected_adler32: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Receive tensors broadcast by ``src`` and load them, all or nothing."""
        group = self._rollouts_peer
        if group is None:
            raise RuntimeError("no peer group: call peer_init first")
        t0 = time.perf_counter()
        received = group.receive(normalize_specs(specs), src)
        recv_s = time.perf_counter() - t0
        _check_expected(received, expected_adler32)
        self._rollouts_generation += 1
        result = apply_weights(self.model_runner.model, received, verify=verify)  # type: ignore[attr-defined]
        result["recv_s"] = round(recv_s, 6)
        return result

    def peer_close(self) -> dict[str, Any]:
        group, self._rollouts_peer = self._rollouts_peer, None
        if group is None:
            return {"closed": False}
        group.close()
        return {"closed": True}

    # -- staged updates and background jobs (module docstring) ------------------------------

    def _start_job(self, kind: str, fn: Any) -> dict[str, Any]:
        job = self._rollouts_job
        if job is not None and job.state == "running":
            raise RuntimeError(f"a background {job.kind} job is still running")
        path = _job_result_path(kind)
        self._rollouts_job = _Job(kind, fn, path)
        return {"kind": kind, "state": "running", "result_path": path}

    def job_status(self) -> dict[str, Any]:
        job = self._rollouts_job
        return {"kind": None, "state": "idle", "result": None, "error": None} if job is None else job.status()

    def stage_from_files(
        self, label: str, paths: list[str], names: list[str] | None = None,
        expected_adler32: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        model = self.model_runner.model  # type: ignore[attr-defined]
        generation = self._rollouts_generation
        self._rollouts_staged = None

        def run() -> dict[str, Any]:
            tensors = _read_safetensors(paths, names)
            _check_expected(tensors, expected_adler32)
            self._rollouts_staged = _stage(model, label, tensors, generation, expected_adler32=expected_adler32)
            return {"staged": label, "tensors": len(tensors), "bytes": sum(t.nbytes for _, t in tensors)}

        return self._start_job("stage", run)

    def stage_from_arena(
        self, label: str, path: str, entries: list[list[Any]], expected_adler32: dict[str, str],
        verify: bool = True, backup_path: str | None = None, backup_offsets: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """Stage tensors the agent decoded into shared memory: zero-copy views of ``path`` (the
        agent's ``/proc/<pid>/fd/<n>``), checked against ``expected_adler32`` now (``verify``;
        the agent that checked them as it decoded passes False) and in any case at the commit,
        on what the engine then holds.

        ``backup_path`` + ``backup_offsets`` (name -> offset): where the agent's host copy holds
        each tensor's bytes as this engine serves them now, unchanged until the commit returns;
        the roll-back copies are then views of it instead of copies of the parameters."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        generation = self._rollouts_generation
        self._rollouts_staged = None
        expected = {n: c.lower() for n, c in expected_adler32.items()}

        def run() -> dict[str, Any]:
            t0 = time.perf_counter()
            memory = _map_shared(path)
            tensors = [
                (str(name), _view_at(memory, str(name), int(offset), dtype_from_str(str(dtype)),
                                     tuple(int(x) for x in shape), "arena"))
                for name, dtype, shape, offset in entries
            ]
            missing = [n for n, _ in tensors if n not in expected]
            if missing:
                raise ValueError(f"no expected Adler-32 for {missing[:8]}")
            t1 = time.perf_counter()
            if verify:
                _check_expected(tensors, expected)
            t2 = time.perf_counter()
            backup = None
            if backup_path is not None:
                offsets = backup_offsets or {}
                missing_backup = [n for n, _ in tensors if n not in offsets]
                if missing_backup:
                    raise ValueError(f"no roll-back bytes given for {missing_backup[:8]}")
                host = _map_shared(backup_path)
                backup = {n: _view_at(host, n, int(offsets[n]), t.dtype, tuple(t.shape), "host copy")
                          for n, t in tensors}
            self._rollouts_staged = _stage(model, label, tensors, generation, backup, expected)
            return {"staged": label, "tensors": len(tensors), "bytes": sum(t.nbytes for _, t in tensors),
                    "map_s": round(t1 - t0, 6), "check_s": round(t2 - t1, 6),
                    "backup_s": round(time.perf_counter() - t2, 6),
                    "backup": "host copy" if backup_path is not None else "copied"}

        return self._start_job("stage", run)

    def peer_stage_send(
        self, host: str, port: int, world_size: int, names: list[str] | None = None,
        backend: str = "gloo", timeout_s: float = 300.0, external_store: bool = False,
    ) -> dict[str, Any]:
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = getattr(self, "device", None) if backend == "nccl" else None

        def run() -> dict[str, Any]:
            group = PeerGroup.create(host, port, 0, world_size, backend=backend, timeout_s=timeout_s, device=device,
                                        external_store=external_store)
            try:
                tensors = _select_views(model, names)
                sent = group.send(tensors, 0)
            finally:
                group.close()
            return {"sent": len(tensors), "bytes": sent}

        return self._start_job("send", run)

    def peer_stage_receive(
        self, label: str, host: str, port: int, rank: int, world_size: int, specs: list[list[Any]],
        expected_adler32: dict[str, str] | None = None, save_path: str | None = None,
        backend: str = "gloo", timeout_s: float = 300.0, external_store: bool = False,
    ) -> dict[str, Any]:
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = getattr(self, "device", None) if backend == "nccl" else None
        generation = self._rollouts_generation
        self._rollouts_staged = None
        wanted = normalize_specs(specs)

        def run() -> dict[str, Any]:
            group = PeerGroup.create(host, port, rank, world_size, backend=backend, timeout_s=timeout_s, device=device,
                                        external_store=external_store)
            try:
                received = group.receive(wanted, 0)
            finally:
                group.close()
            _check_expected(received, expected_adler32)
            if save_path:
                _save_tensors([(n, t.to("cpu")) for n, t in received], save_path)
            self._rollouts_staged = _stage(model, label, received, generation, expected_adler32=expected_adler32)
            return {"staged": label, "tensors": len(received), "bytes": sum(t.nbytes for _, t in received)}

        return self._start_job("stage", run)

    def peer_send_files(
        self, host: str, port: int, world_size: int, paths: list[str], backend: str = "gloo",
        timeout_s: float = 300.0, external_store: bool = False,
    ) -> dict[str, Any]:
        """Broadcast whole files (a delta link's) as rank 0; each is one uint8 tensor named by
        its base name."""
        device = getattr(self, "device", None) if backend == "nccl" else None

        def run() -> dict[str, Any]:
            files = [(os.path.basename(p), _read_file_tensor(p)) for p in paths]
            group = PeerGroup.create(host, port, 0, world_size, backend=backend, timeout_s=timeout_s, device=device,
                                        external_store=external_store)
            try:
                sent = group.send(files, 0)
            finally:
                group.close()
            return {"sent": len(files), "bytes": sent}

        return self._start_job("send", run)

    def peer_receive_files(
        self, host: str, port: int, rank: int, world_size: int, specs: list[list[Any]],
        expected_adler32: dict[str, str], out_dir: str, backend: str = "gloo", timeout_s: float = 300.0,
        external_store: bool = False,
    ) -> dict[str, Any]:
        """Receive files broadcast by rank 0, check each one's Adler-32, write them to
        ``out_dir`` (created); nothing the engine serves changes."""
        device = getattr(self, "device", None) if backend == "nccl" else None
        wanted = normalize_specs(specs)
        for name, _, _ in wanted:
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(f"refusing file name {name!r}: not a plain file name")

        def run() -> dict[str, Any]:
            t0 = time.perf_counter()
            group = PeerGroup.create(host, port, rank, world_size, backend=backend, timeout_s=timeout_s, device=device,
                                        external_store=external_store)
            t1 = time.perf_counter()
            try:
                received = group.receive(wanted, 0)
            finally:
                group.close()
            t2 = time.perf_counter()
            received = [(n, t.to("cpu")) for n, t in received]
            _check_expected(received, expected_adler32)
            os.makedirs(out_dir, exist_ok=True)
            for name, t in received:
                path = os.path.join(out_dir, name)
                with open(f"{path}.part", "wb") as f:
                    f.write(tensor_bytes(t))
                os.replace(f"{path}.part", path)
            return {"files": len(received), "bytes": sum(t.numel() for _, t in received),
                    "join_s": round(t1 - t0, 6), "transfer_s": round(t2 - t1, 6)}

        return self._start_job("receive", run)

    def checksum_job(self, names: list[str] | None = None) -> dict[str, Any]:
        model = self.model_runner.model  # type: ignore[attr-defined]

        def run() -> dict[str, Any]:
            from concurrent.futures import ThreadPoolExecutor

            views = _select_views(model, names)
            # zlib releases the GIL on large buffers: a few threads read the weights in parallel.
            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                digests = list(pool.map(lambda nt: adler32_hex(nt[1]), views))
            return {"checksums": {n: d for (n, _), d in zip(views, digests)}}

        return self._start_job("checksums", run)

    def commit_staged(self, label: str) -> dict[str, Any]:
        staged = self._rollouts_staged
        if staged is None or staged.label != label:
            have = None if staged is None else staged.label
            raise RuntimeError(f"nothing staged for {label!r} (staged: {have!r})")
        if staged.generation != self._rollouts_generation:
            self._rollouts_staged = None
            raise RuntimeError(f"the stage for {label!r} is stale: the engine's weights changed after it was taken")
        self._rollouts_staged = None
        self._rollouts_generation += 1
        with _BACKUP_LOCK:  # its roll-back copies must not be refilled meanwhile
            return apply_weights(self.model_runner.model, staged.tensors, verify=True,  # type: ignore[attr-defined]
                                 backup=staged.backup, expected_adler32=staged.expected_adler32)

    def discard_staged(self) -> dict[str, Any]:
        staged, self._rollouts_staged = self._rollouts_staged, None
        return {"discarded": None if staged is None else staged.label}
