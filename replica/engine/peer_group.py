"""The broadcast of tensors or whole files from one engine to the others (the walk's peers).

A :class:`PeerGroup` is a gloo (CPU) or NCCL (CUDA) process group of two or more members meeting
at ``host:port`` (rank 0 hosts the rendezvous store unless ``external_store``), kept outside
torch.distributed's global state so an engine with its own groups (vLLM's) can join many in turn.
Each gloo member binds ``device_host`` (default ``$ROLLOUTS_NODE_ADDRESS``), never what the
hostname resolves to. Wire: the sender broadcasts ``[count, crc32(specs)]``; every member
all-reduces whether it agrees, so mismatched specs (or ``SENDER_FAILED``) fail every member at
once rather than misread bytes or block the sender; then the bytes follow in uint8 chunks of at
most ``PEER_CHUNK_BYTES``, in spec order. A file travels as one uint8 tensor named by its base
name. After a failure mid-stream the group must be closed.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from common import envs
from replica.engine.tensors import dtype_to_str, nbytes

# One packed broadcast per this many bytes: few collective calls, bounded extra memory.
PEER_CHUNK_BYTES = 256 * 1024 * 1024
# The header count of a sender that has nothing to send (it could not read what it offered).
SENDER_FAILED = -1


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


def gloo_options(timeout: Any, device_host: str | None = None) -> Any:
    """Options of a gloo group whose one transport device binds ``device_host`` (default
    ``$ROLLOUTS_NODE_ADDRESS``); None when neither is given (torch's default device)."""
    device_host = device_host or envs.ROLLOUTS_NODE_ADDRESS.get()
    if not device_host:
        return None
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, no stub
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host)]
    return options


def stateless_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout: Any,
    external_store: bool = False,
    device_host: str | None = None,
) -> Any:
    """A gloo or NCCL process group of ``world_size`` members that meet at ``host:port`` (rank
    0 hosts the rendezvous store, unless ``external_store``: another process already does),
    outside torch.distributed's global state, so an engine that already has its own groups
    (vLLM's) can join any number of these, one after another. A gloo member's device binds
    ``device_host`` (module docstring)."""
    master = rank == 0 and not external_store
    store = dist.TCPStore(host, port, world_size, is_master=master, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(f"rollouts-peer/{host}:{port}", store)
    if backend == "gloo":
        options = gloo_options(timeout, device_host)
        if options is None:
            return _Owning(dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), store)
        return _Owning(dist.ProcessGroupGloo(prefixed, rank, world_size, options), store)
    nccl = dist.ProcessGroupNCCL  # only in CUDA builds of torch
    options = nccl.Options()
    options._timeout = timeout
    return _Owning(nccl(prefixed, rank, world_size, options), store)


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
        device_host: str | None = None,
    ) -> PeerGroup:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown peer backend {backend!r} (gloo or nccl)")
        if backend == "nccl":
            dev = device or torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        group = stateless_group(
            host,
            int(port),
            int(rank),
            int(world_size),
            backend,
            timedelta(seconds=timeout_s),
            external_store,
            device_host,
        )
        return cls(backend, int(rank), int(world_size), group, dev)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
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
        sizes = [nbytes(d, s) for _, d, s in specs]
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

    def send_failure(self, src: int) -> None:
        """Tell every receiver that this sender has nothing to send (`SENDER_FAILED` as the
        header's count), so each fails at once rather than at the group's timeout."""
        self.broadcast(torch.tensor([SENDER_FAILED, 0], dtype=torch.int64, device=self.device), src)
        self.count_failures(True)

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
        if int(header[0]) == SENDER_FAILED:
            raise ValueError("the sender failed before it sent anything (its log says why)")
        if not agreed:
            raise ValueError(
                f"peer sent {int(header[0])} tensors with spec digest {int(header[1])}, "
                f"this receiver expected {want[0]} with digest {want[1]}: the two sides disagree "
                "on names, dtypes, shapes or order"
            )
        sizes = [nbytes(d, s) for _, d, s in specs]
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
