"""rollouts' worker extension: the RPC surface of the code inside a replica's vLLM engine.

vLLM mixes ``WeightLoaderExtension`` into its worker (``--worker-extension-cls``,
`replica.launch.EXTENSION_CLS`); each public method is reached through ``POST /collective_rpc``
and runs on every tensor-parallel rank, one result per rank (`contracts.engine_ranks`).
Invariants: arguments are JSON-able and every method returns a dict; a method that raises
changes nothing; waits are bounded inside the methods (never vLLM's ``timeout`` field, whose
late reply would answer the next RPC); tensors are named as in the engine's starting
checkpoint and reached only through this worker's `weight_map.WeightMap`. The methods are thin
wrappers over vLLM-free functions (`stage`, `updates`, `weight_map`, `tensors`, `jobs`).
Importing this module in a vLLM process installs the CPU patches (`cpu_gemm`, `cpu_moe`,
`post_load`); elsewhere it does not load vLLM.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from common.processes import freeze_heap
from replica import rpc_file
from replica.engine import cpu_gemm, cpu_moe, post_load, updates
from replica.engine.files import Checkpoint, plain_file_name, save_tensors
from replica.engine.jobs import JobRunner
from replica.engine.peer_group import PeerGroup
from replica.engine.plugin import idle_spin_cap, logprob_ranks_eager, vocab_masks_eager
from replica.engine.stage import Stage, StageSlot
from replica.engine.step_delay import set_step_delay
from replica.engine.tensors import ALGORITHMS, dtype_to_str
from replica.engine.weight_map import WeightMap
from replica.peer_join import PeerJoin

if "vllm" in sys.modules:  # the worker imports this module before it loads the model
    cpu_gemm.install()
    cpu_moe.install()
    post_load.install()

_MAP_LOCK = threading.Lock()


def _weight_map(worker: Any) -> WeightMap:
    """This worker's map, built on the RPC thread the first time (no forward pass runs there
    meanwhile: `WeightMap.build`), under a lock all the same."""
    with _MAP_LOCK:
        if worker._rollouts_map is None:
            t0 = time.perf_counter()
            config = worker.model_config
            with Checkpoint(config.model) as checkpoint:  # each file opened once, read in file order
                worker._rollouts_map = WeightMap.build(
                    worker.model_runner.model, checkpoint.specs, checkpoint.read, getattr(config, "quantization", None)
                )
            freeze_heap()  # the model's and the map's objects (`common.processes`)
            worker._rollouts_map_build_s = round(time.perf_counter() - t0, 3)
        wmap: WeightMap = worker._rollouts_map
        return wmap


def _jobs(worker: Any) -> JobRunner:
    if worker._rollouts_jobs is None:
        worker._rollouts_jobs = JobRunner()
    jobs: JobRunner = worker._rollouts_jobs
    return jobs


def _slot(worker: Any) -> StageSlot:
    if worker._rollouts_slot is None:
        worker._rollouts_slot = StageSlot()
    slot: StageSlot = worker._rollouts_slot
    return slot


def _start_stage(worker: Any, fn: Callable[[], tuple[Stage, dict[str, Any]]]) -> dict[str, Any]:
    slot = _slot(worker)
    slot.begin()

    def run() -> dict[str, Any]:
        stage, report = fn()
        slot.put(stage)
        return report

    return _jobs(worker).start("stage", run)


def _joiner(worker: Any, join: dict[str, Any]) -> Callable[[], PeerGroup]:
    """What forms the group ``join`` (a `PeerJoin` as JSON) describes, when the job runs."""
    j = PeerJoin.of(join)
    device = getattr(worker, "device", None) if j.backend == "nccl" else None
    return functools.partial(
        PeerGroup.create,
        j.host,
        j.port,
        j.rank,
        j.world_size,
        backend=j.backend,
        timeout_s=j.timeout_s,
        device=device,
        external_store=j.external_store,
    )


def _rank(worker: Any) -> tuple[int, int]:
    """(this worker's tensor-parallel rank, the engine's tensor-parallel size)."""
    config = getattr(worker, "parallel_config", None)
    return int(getattr(worker, "rank", 0) or 0), int(getattr(config, "tensor_parallel_size", 1) or 1)


def _one_rank_only(worker: Any, what: str) -> None:
    rank, ranks = _rank(worker)
    if ranks > 1:
        raise ValueError(
            f"{what} needs a tensor-parallel size of 1 (this engine runs {ranks} ranks, each holding "
            "a shard): its peers take the delta's files or read the bucket"
        )


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (module docstring). Every attribute here becomes a worker
    attribute (vLLM asserts there is no clash) and every callable one an RPC method, so helpers
    live at module level and the only state is the job runner and the stage slot."""

    _rollouts_jobs: JobRunner | None = None
    _rollouts_slot: StageSlot | None = None
    _rollouts_map: WeightMap | None = None
    _rollouts_map_build_s: float = 0.0

    def weight_map(self) -> dict[str, Any]:
        wmap = _weight_map(self)
        refused = {n: e.refused for n, e in wmap.entries.items() if e.refused is not None}
        return {
            "tensors": len(wmap.entries),
            "held": len(wmap.names()),
            "refused": dict(list(refused.items())[:16]),
            "refused_count": len(refused),
            "build_s": self._rollouts_map_build_s,
            "elsewhere": wmap.elsewhere(),
        }

    def refuse_tensors(self, names: list[str], why: str) -> dict[str, Any]:
        _weight_map(self).refuse(names, why)
        return {"refused": len(names)}

    def call_from_file(self, path: str) -> dict[str, Any]:
        """The call the agent wrote to ``path`` (`replica.rpc_file`: arguments too large for a
        request body), run as if it came over ``/collective_rpc``."""
        method, args, kwargs = rpc_file.read_call(path)
        if not callable(getattr(WeightLoaderExtension, method, None)):
            raise ValueError(f"{path}: no extension method {method!r}")
        answer: dict[str, Any] = getattr(self, method)(*args, **kwargs)
        return answer

    def engine_pid(self) -> dict[str, Any]:
        rank, ranks = _rank(self)
        return {
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "idle_spin_s": idle_spin_cap(),
            "logprob_ranks_eager": logprob_ranks_eager(),
            "vocab_masks_eager": vocab_masks_eager(),
            "gc_enabled": gc.isenabled(),
            "kv_cache_bytes": getattr(self, "cache_config").kv_cache_memory_bytes,  # vLLM's worker: the mixin's host
            "rank": rank,
            "ranks": ranks,
        }

    def weight_checksums(self, names: list[str] | None = None, algorithm: str = "adler32") -> dict[str, Any]:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}: one of {sorted(ALGORITHMS)}")
        wmap = _weight_map(self)
        whole, regions = updates.split_sliced(wmap, names)
        digest = ALGORITHMS[algorithm]
        return {
            "algorithm": algorithm,
            "checksums": {n: digest(t) for n, t in wmap.select(whole)},
            "regions": {n: updates.region_digests(wmap, n, digest) for n in regions},
            "engine_checksums": {} if names is not None else {n: digest(t) for n, t in wmap.unmapped().items()},
        }

    def save_weights(self, names: list[str] | None, path: str) -> dict[str, Any]:
        tensors = _weight_map(self).select(names)
        save_tensors(tensors, path)
        return {
            "saved": [n for n, _ in tensors],
            "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "path": path,
        }

    def weight_specs(self, names: list[str] | None = None) -> dict[str, Any]:
        wmap = _weight_map(self)
        entries = [wmap.entry(n) for n in (wmap.names() if names is None else names)]
        return {"specs": [[e.name, dtype_to_str(e.dtype), list(e.shape)] for e in entries]}

    def job_status(self, kind: str | None = None) -> dict[str, Any]:
        return _jobs(self).status(kind)

    def stage_from_files(
        self,
        label: str,
        paths: list[str],
        names: list[str] | None = None,
        expected_adler32: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        wmap = _weight_map(self)
        return _start_stage(self, lambda: updates.stage_from_files(wmap, label, paths, names, expected_adler32))

    def stage_from_arena(
        self,
        label: str,
        path: str,
        entries: list[list[Any]],
        expected_adler32: dict[str, str],
        verify: bool = True,
        backup_path: str | None = None,
        backup_offsets: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        wmap = _weight_map(self)
        return _start_stage(
            self,
            lambda: updates.stage_from_arena(
                wmap, label, path, entries, expected_adler32, verify, backup_path, backup_offsets
            ),
        )

    def peer_stage_receive(
        self,
        join: dict[str, Any],
        label: str,
        specs: list[list[Any]],
        expected_adler32: dict[str, str] | None = None,
        save_path: str | None = None,
    ) -> dict[str, Any]:
        _one_rank_only(self, "receiving a stage from a peer engine")
        wmap = _weight_map(self)
        group = _joiner(self, join)
        return _start_stage(
            self, lambda: updates.stage_from_peer(wmap, label, group, specs, expected_adler32, save_path)
        )

    def peer_stage_send(self, join: dict[str, Any], names: list[str] | None = None) -> dict[str, Any]:
        _one_rank_only(self, "sending this engine's tensors to peers")
        wmap = _weight_map(self)
        group = _joiner(self, join)
        return _jobs(self).start("send", lambda: updates.send_views(wmap, names, group))

    def peer_send_files(self, join: dict[str, Any], paths: list[str]) -> dict[str, Any]:
        # Beside a stage job (files, not weights): the early offer's sender stages the same update.
        if _rank(self)[0]:  # files are the agent's: one rank of the engine moves them
            return _jobs(self).start("send", lambda: {"skipped": f"rank {_rank(self)[0]}"}, beside=True)
        group = _joiner(self, join)
        return _jobs(self).start("send", lambda: updates.send_files(paths, group), beside=True)

    def peer_receive_files(
        self, join: dict[str, Any], specs: list[list[Any]], expected_adler32: dict[str, str], out_dir: str
    ) -> dict[str, Any]:
        for spec in specs:
            plain_file_name(str(spec[0]))
        if _rank(self)[0]:
            return _jobs(self).start("receive", lambda: {"skipped": f"rank {_rank(self)[0]}"})
        group = _joiner(self, join)
        return _jobs(self).start("receive", lambda: updates.receive_files(specs, expected_adler32, out_dir, group))

    def checksum_job(self, names: list[str] | None = None) -> dict[str, Any]:
        wmap = _weight_map(self)
        return _jobs(self).start("checksums", lambda: updates.served_checksums(wmap, names))

    def swap_staged(self, label: str) -> dict[str, Any]:
        return _slot(self).swap(_weight_map(self), label)

    def commit_staged(self, label: str, hold: bool = False, checksums: bool = True) -> dict[str, Any]:
        return _slot(self).commit(_weight_map(self), label, hold, checksums)

    def swap_and_commit_staged(self, label: str, hold: bool = False, checksums: bool = True) -> dict[str, Any]:
        return _slot(self).swap_and_commit(_weight_map(self), label, hold, checksums)

    def release_staged(self, label: str) -> dict[str, Any]:
        return _slot(self).release(label)

    def discard_staged(self) -> dict[str, Any]:
        return _slot(self).discard(_weight_map(self))

    def set_step_delay(self, seconds: float) -> dict[str, Any]:
        return set_step_delay(self, seconds)
