"""One replica: a vLLM engine, the host copy of its weights, and its Temporal agent.

`run_replica` reclaims the shared memory of dead engines (`replica.shm_reclaim`), downloads the
deployment's model from the bucket, starts the engine (vLLM's OpenAI server with our worker
extension, behind the replica's secret: `replica.engine_guard`), loads the host copy of the
weights (checkpoint format, what deltas apply to), starts a Temporal worker on the replica's own
task queue (running `replica.activities`), and tells its deployment workflow it is ready. If
the engine dies, the replica reports the failure to its deployment and exits; SIGTERM stops the
engine and exits.

`ReplicaRuntime` owns the all-or-nothing bookkeeping of an update: staging (host copy and an
engine stage, nothing the engine serves changes), the swap inside one short pause, the proof,
commit and roll-back; from the bucket, or from a peer's broadcast (`stage_from_peer` then
`commit_peer_stage`). Delta links it fetched or received stay in `links_root` so that it can
offer them to its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from common.processes import PidFile, free_port, stop_pid
from common.settings import Settings, temporal_client
from contracts import names
from contracts.activities import (
    ApplySnapshotInput,
    ApplySnapshotResult,
    PeerOffer,
    PeerOfferInput,
    StageFromPeerResult,
)
from contracts.records import (
    PromptCachePolicy,
    ReplicaEndpoint,
    ReplicaFailure,
    SnapshotRef,
    SnapshotType,
    rfc3339,
)
from replica.shm_reclaim import reclaim_dead_segments
from replica.stage_arena import StageArena, decode_turn_marker, host_decode_slot
from snapshots.storage import snapshot_uri

log = logging.getLogger("rollouts.replica")
# Joining a peer group blocks the engine until the other side joins: keep the wait short.
PEER_JOIN_TIMEOUT_S = 30.0


def engine_alive(engine: Any) -> bool:
    from replica.engine import _pid_alive

    return engine.pid is not None and _pid_alive(engine.pid)


def engine_options(engine_config: dict[str, str]) -> dict[str, Any]:
    """EngineProcess options from a deployment's runtime.engineConfig: the sizes it knows by
    name, every other key as a vLLM flag (`--key value`, or `--key` for an empty value)."""
    config = dict(engine_config)
    options: dict[str, Any] = {}
    if "max-model-len" in config:
        options["max_model_len"] = int(config.pop("max-model-len"))
    if "max-num-seqs" in config:
        options["max_num_seqs"] = int(config.pop("max-num-seqs"))
    extra: list[str] = []
    for key, value in sorted(config.items()):
        extra += [f"--{key}"] + ([value] if value else [])
    if extra:
        options["extra_args"] = extra
    return options


def one_line(exc: BaseException, limit: int = 400) -> str:
    """The first and last lines of an error (an engine's start error carries its log tail)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class StagedUpdate:
    """An update prepared off the serving path; nothing the engine sees has changed yet."""

    names: list[str] = field(default_factory=list)
    path: Path | None = None
    links: list[str] = field(default_factory=list)
    bytes_read: int = 0
    new_host: Any = None  # a new HostWeights when the chain starts from another full base
    backups: dict[str, np.ndarray] = field(default_factory=dict)  # old bytes of in-place changes
    expected: dict[str, str] = field(default_factory=dict)  # Adler-32 of each staged tensor
    changed_by_link: dict[str, list[str] | None] = field(default_factory=dict)
    # New bytes decoded into the stage arena (the host copy adopts them after the swap).
    decoded: dict[str, np.ndarray] = field(default_factory=dict)
    arena_offsets: dict[str, int] = field(default_factory=dict)
    nothing_to_do: bool = False
    new_host_arena: StageArena | None = None  # the shared memory `new_host` lives in
    identity: str = ""
    link_dirs: dict[str, Path] = field(default_factory=dict)  # local files of each delta link


class ReplicaRuntime:
    """State shared by the agent's activities: the engine, the host copy and what it serves.

    Every update is staged first, the engine still serving: a delta chain is decoded once, by
    the host copy, into the shared stage arena (`replica.stage_arena`; the host copy itself does
    not change yet) and the engine stages views of those bytes; a new full base goes through a
    staging file. A tensor whose name, shape or dtype differs from the engine's parameter is
    refused there, before any pause. Then it is swapped in inside one short pause, where the
    engine also reads back the Adler-32 of every swapped tensor against the snapshot's (the
    proof): a difference rolls back the engine's tensors, the weight-version label and the host
    copy, then resumes on the old weights. Only a proven swap commits the chain; the host copy
    adopts the same bytes on a thread after the step returns, and every later step waits for
    that first (`settled`). The host copy lives in shared memory and is the engine's roll-back
    source for a delta stage. A failure at any point leaves the engine, its label and the host
    copy exactly as they were, and the error says what was read back to show it.
    """

    def __init__(self, *, name: str, engine: Any, host: Any, s3: Any, workdir: Path,
                 peer_host: str = "127.0.0.1", peer_backend: str = "gloo",
                 host_arena: StageArena | None = None) -> None:
        self.name = name
        self.engine = engine
        self.host = host
        # The shared memory `host` lives in (None: private memory): the engine's roll-back
        # copies of a delta stage are views of it (`replica.stage_arena`).
        self.host_arena = host_arena
        self.s3 = s3
        self.workdir = workdir
        self.staging = workdir / "staging"
        self.peer_host = peer_host
        self.peer_backend = peer_backend
        # Identities of the chain the replica serves, full base first; ["initial"] at start.
        self.applied: list[str] = ["initial"]
        # Tensors each applied link changed (None: not known, so treat as all).
        self.changed_by_link: dict[str, list[str] | None] = {}
        self.peer_stage: PeerStage | None = None
        self.link_dirs: dict[str, Path] = {}
        self.lock = asyncio.Lock()
        self.arena = StageArena()  # where delta updates are decoded for the engine
        self.peer_store: Any = None  # the rendezvous store of the broadcast this replica sends
        self._adopting: asyncio.Future[None] | None = None  # the host copy taking the last swap
        # Per hot-load id: resolves with the bucket update's stage once it is checked (an early
        # offer waits on it), or fails if the update ended without one.
        self.update_stages: dict[str, asyncio.Future[StagedUpdate]] = {}
        self.offered_links: dict[int, Path] = {}  # files offered to peers, by the offer's port

    @property
    def current_identity(self) -> str:
        return self.applied[-1]

    # ------------------------------------------------------------------ from the bucket
    @property
    def links_root(self) -> Path:
        """Delta links this replica fetched or received, kept to offer them to peers."""
        return self.staging / "links"

    def clear_links(self) -> None:
        shutil.rmtree(self.links_root, ignore_errors=True)
        self.link_dirs = {}

    def missing_links(self, inp: ApplySnapshotInput) -> list[SnapshotRef] | None:
        """The delta links to apply on top of what this replica serves; None when it needs the
        chain's full base (a new base, or a replica still on its initial weights)."""
        wanted = [link.identity for link in inp.chain]
        have = len(self.applied)
        if have <= len(wanted) and self.applied == wanted[:have] and self.applied[0] != "initial":
            return list(inp.chain[have:])
        return None

    def fetch_links(self, inp: ApplySnapshotInput, links: list[SnapshotRef]) -> tuple[dict[str, Path], int]:
        """Download delta links' files into `links_root`; returns their directories and bytes."""
        dirs: dict[str, Path] = {}
        total = 0
        for link in links:
            dest = self.links_root / link.identity
            prefix = "/".join(p for p in (inp.path_prefix.strip("/"), link.identity) if p)
            total += download_prefix(self.s3, inp.bucket, prefix, dest)
            dirs[link.identity] = dest
        return dirs, total

    async def stage_update(
        self, inp: ApplySnapshotInput, local_links: dict[str, Path] | None = None,
        turn: tuple[str, int] | None = None,
    ) -> StagedUpdate:
        """Stage an update for the engine, off the serving path; the host copy is not changed.

        Delta links held locally are decoded once, by the host copy, into the stage arena (every
        changed tensor's Adler-32 checked there), and the engine stages views of those bytes
        (`replica.stage_arena`); a new full base goes through a staging file the engine reads."""
        todo = self.missing_links(inp)
        local = local_links or {}
        if todo and all(link.identity in local for link in todo):
            t_wait = time.perf_counter()
            async with host_decode_slot(self.arena.directory, turn):
                t0 = time.perf_counter()
                staged = await asyncio.to_thread(self.decode_links, inp, todo, local)
                t1 = time.perf_counter()
                entries = [[n, self.host.info(n).torch_dtype, list(self.host.info(n).shape), offset]
                           for n, offset in staged.arena_offsets.items()]
                try:
                    # The decode just checked these bytes; the commit checks what the engine holds.
                    job = await self.engine.stage_from_arena(staged.identity, self.arena.path, entries,
                                                             staged.expected, verify=False,
                                                             backup=self._host_backup(staged.names))
                except Exception as exc:
                    with contextlib.suppress(Exception):
                        await self.engine.discard_staged()
                    raise EngineUpdateError(f"the engine could not stage the update; it serves its previous "
                                            f"weights: {one_line(exc)}") from None
            log.info("staged %s: waited %.0f ms for the host's decode slot, decode %.0f ms, engine stage %.0f ms "
                     "(%s)", staged.identity, (t0 - t_wait) * 1000, (t1 - t0) * 1000, _ms_since(t1),
                     _fmt({k: 1000 * float(v) for k, v in job.items() if k.endswith("_s") or k == "seconds"}))
            return staged
        staged = await asyncio.to_thread(self.stage_chain, inp, local)
        if staged.nothing_to_do:
            return staged
        try:
            await self.engine.stage_from_files(
                staged.identity, [str(staged.path)], staged.names, expected_adler32=staged.expected
            )
        except Exception as exc:
            self.host.restore(staged.backups)
            staged.path.unlink(missing_ok=True)  # type: ignore[union-attr]
            raise EngineUpdateError(f"the engine could not stage the update; it serves its previous "
                                    f"weights: {one_line(exc)}") from None
        return staged

    def _host_backup(self, names_: list[str]) -> tuple[str, dict[str, int]] | None:
        """Where the engine finds its roll-back bytes for `names_`: the host copy, when it lives
        in shared memory (it holds exactly what the engine serves until the commit returns)."""
        if self.host_arena is None:
            return None
        try:
            return self.host_arena.path, {n: self.host_arena.offset_of(self.host.raw(n)) for n in names_}
        except ValueError:  # the host copy is not (all) in that arena: the engine copies instead
            return None

    def decode_links(self, inp: ApplySnapshotInput, todo: list[SnapshotRef], local: dict[str, Path]) -> StagedUpdate:
        """Decode the missing delta links (local directories) into the stage arena, in chain
        order, against the host copy (which does not change); each link's tensors are checked
        against their recorded Adler-32. Raises SnapshotError naming file and tensor."""
        from snapshots.inspect import read_delta_plan

        plans = [read_delta_plan(local[link.identity]) for link in todo]
        sizes: dict[str, int] = {}
        for plan in plans:
            for name in plan.tensors:
                if name in self.host and name not in sizes:
                    sizes[name] = self.host.info(name).nbytes
        layout = self.arena.reserve(list(sizes.items()))
        out = {n: self.arena.view(offset, nbytes) for n, (offset, nbytes) in layout.items()}
        staged = StagedUpdate(identity=inp.identity)
        decoded: set[str] = set()
        for link, plan in zip(todo, plans):
            report = self.host.decode_delta_into(plan, out, decoded)
            decoded.update(report.changed)
            staged.expected.update(report.checksums)
            staged.changed_by_link[link.identity] = list(report.changed)
            staged.links.append(link.identity)
            staged.link_dirs[link.identity] = Path(local[link.identity])
        staged.names = sorted(decoded)
        staged.decoded = {n: out[n] for n in staged.names}
        staged.arena_offsets = {n: layout[n][0] for n in staged.names}
        return staged

    def _adopt(self, staged: StagedUpdate) -> None:
        """After the engine took an arena stage: the host copy takes the same checked bytes."""
        if staged.decoded:
            self.host.restore(staged.decoded, checksums=staged.expected)
            staged.decoded = {}

    def _adopt_later(self, staged: StagedUpdate) -> None:
        """Adopt on a thread once the swap is proven, off the step's path: the walk's next
        replica need not wait for this copy. Every later use of the host copy (and of the stage
        arena, which the next decode reuses) waits for it first (`settled`)."""
        if staged.decoded:
            self._adopting = asyncio.ensure_future(asyncio.to_thread(self._adopt, staged))

    async def settled(self) -> None:
        """Wait until the host copy has adopted the last swapped update (`_adopt_later`)."""
        adopting = self._adopting
        if adopting is None:
            return
        try:
            await asyncio.shield(adopting)
        except asyncio.CancelledError:
            if not adopting.done():
                raise
        except Exception as exc:
            # The host copy is no longer what the engine serves: no later update may use it.
            raise EngineUpdateError(f"the host copy could not take the last update: {one_line(exc)}; "
                                    f"restart the replica") from None
        if self._adopting is adopting:
            self._adopting = None

    def stage_chain(self, inp: ApplySnapshotInput, local_links: dict[str, Path] | None = None) -> StagedUpdate:
        """Apply the chain links this replica is missing to its host copy (or load a new full
        base) and write the changed tensors to a staging file; the engine is not touched. (The
        usual delta update takes `decode_links` instead, which leaves the host copy as it is.)

        A delta link comes from `local_links` when given (received from a peer), else its files
        are downloaded from the bucket into `links_root` first (a delta's files hold only the
        changed tensors, so that is what a ranged read would fetch) and kept for peers."""
        from snapshots.errors import ChainError
        from snapshots.host import HostWeights
        from snapshots.inspect import read_delta_plan

        wanted = [link.identity for link in inp.chain]
        if self.applied == wanted:
            return StagedUpdate(nothing_to_do=True)
        staged = StagedUpdate()
        if not inp.chain or inp.chain[0].type != SnapshotType.FULL:
            raise ChainError("the snapshot chain must start with a full snapshot")
        have = len(self.applied)
        incremental = have < len(wanted) and self.applied == wanted[:have] and self.applied[0] != "initial"
        if incremental:
            todo: list[SnapshotRef] = inp.chain[have:]
            target = self.host
        else:
            base = inp.chain[0]
            staged.new_host_arena = StageArena()
            target = HostWeights.load(snapshot_uri(inp.bucket, inp.path_prefix, base.identity), s3=self.s3,
                                      allocate=staged.new_host_arena.allocate)
            staged.new_host = target
            staged.bytes_read += target.total_bytes
            staged.links.append(base.identity)
            staged.changed_by_link[base.identity] = None
            todo = inp.chain[1:]
        changed: set[str] = set()
        try:
            for link in todo:
                location = (local_links or {}).get(link.identity)
                if location is None:
                    location = self.links_root / link.identity
                    prefix = "/".join(p for p in (inp.path_prefix.strip("/"), link.identity) if p)
                    staged.bytes_read += download_prefix(self.s3, inp.bucket, prefix, location)
                plan = read_delta_plan(location)
                if staged.new_host is None:
                    # Each delta is all-or-nothing; a chain of several is undone from these copies.
                    fresh = [n for n in plan.tensors if n not in staged.backups and n in target]
                    staged.backups.update(target.save(fresh))
                link_changed = target.apply_delta(plan)
                changed.update(link_changed)
                staged.changed_by_link[link.identity] = list(link_changed)
                staged.links.append(link.identity)
                staged.link_dirs[link.identity] = Path(location)
        except Exception:
            self.host.restore(staged.backups)
            raise
        staged.identity = inp.identity
        staged.names = sorted(target.names() if staged.new_host is not None else changed)
        staged.expected = {n: c for n, c in target.checksums().items() if n in set(staged.names)}
        staged.path = self._write_staging(target, staged.names, inp.identity)
        return staged

    def _write_staging(self, host: Any, names_: list[str], label: str) -> Path:
        from safetensors.torch import save_file

        self.staging.mkdir(parents=True, exist_ok=True)
        path = self.staging / f"{label}.safetensors"
        save_file({n: host.tensor(n).contiguous() for n in names_}, str(path))
        return path

    def update_stage(self, hot_load_id: str, fresh: bool = False) -> asyncio.Future[StagedUpdate]:
        """The future an early offer waits on for `hot_load_id`'s update from the bucket; `fresh`
        (an update starting): a new one unless an offer is already waiting on the current one."""
        current = self.update_stages.get(hot_load_id)
        if current is None or (fresh and current.done()):
            current = asyncio.get_running_loop().create_future()
            self.update_stages.pop(hot_load_id, None)
            self.update_stages[hot_load_id] = current
            while len(self.update_stages) > 4:  # only the latest few hot-loads can still ask
                stale = self.update_stages.pop(next(iter(self.update_stages)))
                if not stale.done():
                    stale.cancel()
        return current

    async def apply_from_bucket(self, inp: ApplySnapshotInput) -> ApplySnapshotResult:
        from snapshots.errors import ChainError

        ready = self.update_stage(inp.hot_load_id, fresh=True)
        try:
            return await self._apply_from_bucket(inp, ready)
        finally:
            if not ready.done():
                ready.set_exception(ChainError(f"replica {self.name}'s update to {inp.identity} ended before it "
                                               f"staged anything to offer"))
                ready.exception()  # retrieved: nobody may be waiting

    async def _apply_from_bucket(self, inp: ApplySnapshotInput, ready: asyncio.Future[StagedUpdate]) -> ApplySnapshotResult:
        t0 = time.perf_counter()
        await self.drop_peer_stage()  # settles the host copy first
        await asyncio.to_thread(self.clear_links)
        todo = self.missing_links(inp) or []
        local, fetched = await asyncio.to_thread(self.fetch_links, inp, todo)
        timings = {"fetch": _ms_since(t0)}
        t1 = time.perf_counter()
        staged = await self.stage_update(inp, local)
        timings["stage"] = _ms_since(t1)
        if not ready.done():
            ready.set_result(staged)  # checked and staged: peers may take its files from here on
        if staged.nothing_to_do:
            verified = await self.prove(self.host.names())
            return ApplySnapshotResult(
                identity=inp.identity, engine_pid=self.engine.pid, tensors_loaded=0, bytes_read_from_bucket=0,
                pause_ms=0.0, stage_ms=timings["stage"], verified_tensors=verified,
            )
        pause_ms, prove_ms, verified = await self._swap_in(staged, [link.identity for link in inp.chain],
                                                           inp.prompt_cache_policy)
        timings.update(pause=pause_ms, prove=prove_ms, total=_ms_since(t0))
        log.info("applied %s from the bucket: %s", inp.identity, _fmt(timings))
        return ApplySnapshotResult(
            identity=inp.identity, engine_pid=self.engine.pid, tensors_loaded=len(staged.names),
            bytes_read_from_bucket=staged.bytes_read + fetched, pause_ms=pause_ms, links_applied=staged.links,
            stage_ms=timings["fetch"] + timings["stage"], source="bucket", verified_tensors=verified,
        )

    async def _swap_in(self, staged: StagedUpdate, chain_ids: list[str],
                       policy: PromptCachePolicy) -> tuple[float, float, int]:
        """Swap a stage in and prove it (one pause), then commit the chain and start the host
        copy's adoption; returns (pause ms, ms of the proof inside it, tensors proven)."""
        try:
            pause_ms, swap = await self._swap_staged(staged.identity, staged.backups, staged.names, policy)
        finally:
            if staged.path is not None:
                staged.path.unlink(missing_ok=True)
        self._adopt_later(staged)
        self._commit(chain_ids, staged.new_host, staged.changed_by_link, staged.new_host_arena)
        self.link_dirs = staged.link_dirs
        return pause_ms, 1000 * float(swap.get("verify_s", 0.0)), int(swap["verified"])

    async def _swap_staged(self, label: str, host_backups: dict[str, np.ndarray], names_: list[str],
                           policy: PromptCachePolicy) -> tuple[float, dict[str, Any]]:
        """Pause (keeping requests), swap the engine's stage in and prove it, resume; all or
        nothing. Everything that can refuse the update runs inside the pause, before the
        replica serves a token of it: the engine reads back every swapped tensor against the
        snapshot's Adler-32 and rolls its tensors back on any difference; then the label goes
        back too and the host copy is restored. Returns the pause in ms and the engine's swap
        report (``verified``: tensors proven; ``checksums`` where proven by Adler-32)."""
        # RESET_ALL: clear the KV cache at the pause, so paused requests are recomputed on the new
        # weights after the resume and no prefix computed under the old ones is reused.
        reset = policy == PromptCachePolicy.RESET_ALL
        t0 = time.perf_counter()
        previous = self.current_identity
        try:
            await self.engine.pause(mode="keep", clear_cache=reset)
            try:
                # Label first, then weights, both inside the pause (no step runs in between, so no
                # token sees one without the other); a failed swap puts the old label back.
                await self.engine.set_weight_version(label)
                try:
                    swap = await self.engine.commit_staged(label)
                    if int(swap.get("verified", -1)) != len(names_):
                        raise EngineUpdateError(f"the engine proved {swap.get('verified')} of {len(names_)} "
                                                f"swapped tensor(s)")
                except BaseException:
                    with contextlib.suppress(Exception):
                        await self.engine.set_weight_version(previous)
                    raise
                log.info("swap of %d tensor(s) in the pause: %s", len(names_),
                         _fmt({k: 1000 * v for k, v in swap.items() if k.endswith("_s")}))
            finally:
                await self.engine.resume()
        except Exception as exc:
            # The engine's own swap is all-or-nothing; the host copy is put back here.
            self.host.restore(host_backups)
            raise EngineUpdateError(
                f"loading {len(names_)} tensor(s) into the engine failed; {await self._kept_previous(names_)}: "
                f"{one_line(exc)}"
            ) from None
        return (time.perf_counter() - t0) * 1000, swap

    async def _kept_previous(self, names_: list[str]) -> str:
        """After a refused swap: read back what the engine serves (label and the swapped
        tensors) against the host copy, and say so."""
        try:
            label = await self.engine.weight_version()
            await self.prove(names_)
        except Exception as exc:  # noqa: BLE001 - reported in the replica's error
            return (f"the engine could not be shown to serve its previous weights ({one_line(exc, 200)}); "
                    f"restart the replica")
        if label != self.current_identity:
            return f"the engine serves its previous weights but is labelled {label!r}; restart the replica"
        return f"it serves its previous weights ({self.current_identity}, {len(names_)} tensor(s) read back)"

    def _commit(self, chain_ids: list[str], new_host: Any, changed: dict[str, list[str] | None],
                new_host_arena: StageArena | None = None) -> None:
        if new_host is not None:
            self.host = new_host
            self.host_arena = new_host_arena
            self.changed_by_link = {}
        self.changed_by_link.update(changed)
        self.applied = list(chain_ids)

    def _commit_offer(self, offer: PeerOffer, names_: list[str]) -> list[str]:
        """Record that this replica now serves the offer's chain, having taken `names_` from a
        peer's tensors; returns the chain's identities."""
        chain_ids = [link.identity for link in offer.chain]
        missing = chain_ids if offer.base_identity == "*" else chain_ids[chain_ids.index(offer.base_identity) + 1 :]
        # Per-link changes are known only when one link was missing (the usual rolling update).
        changed: dict[str, list[str] | None] = {i: None for i in missing}
        if len(missing) == 1 and offer.base_identity != "*":
            changed[missing[0]] = names_
        if offer.base_identity == "*":
            self.changed_by_link = {}
        self._commit(chain_ids, None, changed)
        return chain_ids

    async def prove(self, names_: list[str]) -> int:
        """Compare the Adler-32 of what the engine serves for `names_` (computed now, on its
        background thread) with the host copy's verified ones; EngineUpdateError naming the
        tensors that differ. (A swap is proven inside its pause instead: `_swap_staged`.)"""
        if not names_:
            return 0
        served = await self.engine.served_checksums(names_)
        expected = self.host.checksums()
        wrong = [n for n in names_ if served.get(n) != expected.get(n)]
        if wrong:
            raise EngineUpdateError(
                f"served weights differ from the snapshot for {len(wrong)} tensor(s): {', '.join(wrong[:5])}"
            )
        return len(names_)

    # ------------------------------------------------------------------ replica to replica
    def make_offer(self, inp: PeerOfferInput) -> PeerOffer:
        """What this replica would send to replicas serving `inp.target_identity`; with
        `inp.host_store`, it also starts hosting the group's rendezvous store (until its send)."""
        return self._hosting_store(inp, self._build_offer(inp))

    def _hosting_store(self, inp: PeerOfferInput, offer: PeerOffer) -> PeerOffer:
        """With `inp.host_store`, start hosting the offer's rendezvous store (until the send)."""
        if not inp.host_store:
            return offer
        from torch.distributed import TCPStore

        # Up before any engine connects: a TCPStore client that finds no master backs off for
        # ~0.7 s, which every member of the group would then wait out.
        self.peer_store = TCPStore(offer.host, offer.port, offer.world_size, is_master=True,
                                   timeout=timedelta(seconds=PEER_JOIN_TIMEOUT_S), wait_for_workers=False)
        return offer.model_copy(update={"store_hosted": True})

    async def make_offer_from_stage(self, inp: PeerOfferInput, wait_s: float = 600.0) -> PeerOffer:
        """The early offer (`inp.from_stage`): once this replica's update of `inp.hot_load_id`
        from the bucket has decoded and checked the delta link's files, offer those files to
        receivers that serve the link's base, before this replica swaps them in. Raises
        ChainError when the update ends without such files (a new base, nothing to do, NCCL)."""
        from snapshots.errors import ChainError

        try:
            staged = await asyncio.wait_for(asyncio.shield(self.update_stage(inp.hot_load_id)), wait_s)
        except TimeoutError:
            raise ChainError(f"replica {self.name} staged nothing for {inp.identity!r} in {wait_s:.0f} s") from None
        chain_ids = [link.identity for link in inp.chain]
        link_dir = staged.link_dirs.get(chain_ids[-1])
        if not (inp.accept_files and self.peer_backend == "gloo" and staged.identity == inp.identity
                and len(chain_ids) > 1 and inp.target_identity == chain_ids[-2] and staged.arena_offsets
                and link_dir is not None and link_dir.is_dir()):
            raise ChainError(f"replica {self.name}'s update to {inp.identity!r} holds no delta files for "
                             f"replicas on {inp.target_identity!r} to take before its swap")
        return self._hosting_store(inp, await asyncio.to_thread(self._files_offer, inp, link_dir))

    def _files_offer(self, inp: PeerOfferInput, link_dir: Path) -> PeerOffer:
        """Offer a delta link's files (checked by this replica's decode) as they are."""
        files = sorted(f for f in link_dir.iterdir() if f.is_file())
        offer = PeerOffer(
            source_replica=self.name, host=self.peer_host, port=free_port(self.peer_host),
            backend=self.peer_backend, base_identity=inp.target_identity, identity=inp.identity,
            chain=inp.chain, specs=[[f.name, "uint8", [f.stat().st_size]] for f in files],
            expected_adler32={f.name: _file_adler32(f) for f in files}, world_size=inp.world_size,
            mode="files",
        )
        self.offered_links = {offer.port: link_dir}  # only the latest offer is ever sent
        return offer

    def _build_offer(self, inp: PeerOfferInput) -> PeerOffer:
        from snapshots.errors import ChainError

        chain_ids = [link.identity for link in inp.chain]
        if self.applied != chain_ids:
            raise ChainError(f"replica {self.name} serves {self.current_identity!r}, not {inp.identity!r}")
        link_dir = self.link_dirs.get(chain_ids[-1])
        if (inp.accept_files and self.peer_backend == "gloo" and len(chain_ids) > 1
                and inp.target_identity == chain_ids[-2] and link_dir is not None and link_dir.is_dir()):
            # The receivers miss exactly the link this replica holds as files: send the delta
            # itself (the changed tensors, XOR+zstd, ~5 % of their bytes for an RL step) rather
            # than the tensors as served; each receiver decodes and checks it against its own copy.
            return self._files_offer(inp, link_dir)
        if inp.target_identity in chain_ids[:-1]:
            missing = chain_ids[chain_ids.index(inp.target_identity) + 1 :]
            known = [self.changed_by_link.get(i) for i in missing]
            if all(k is not None for k in known):
                names_ = sorted({n for k in known for n in k})  # type: ignore[union-attr]
                base = inp.target_identity
            else:
                names_, base = self.host.names(), "*"
        else:
            names_, base = self.host.names(), "*"  # another base: send everything
        checksums = self.host.checksums()
        return PeerOffer(
            source_replica=self.name, host=self.peer_host, port=free_port(self.peer_host),
            backend=self.peer_backend, base_identity=base, identity=inp.identity, chain=inp.chain,
            specs=[[n, str(self.host.tensor(n).dtype).removeprefix("torch."), list(self.host.info(n).shape)] for n in names_],
            expected_adler32={n: checksums[n] for n in names_}, world_size=inp.world_size,
        )

    # ------------------------------------------------------------------ broadcast walk
    async def send_to_peers(self, offer: PeerOffer) -> int:
        """Broadcast the offered tensors (or delta files) from this engine to every receiver of
        the offer's group (they join concurrently); the engine keeps serving while it sends."""
        try:
            if offer.mode == "files":
                link_dir = self.offered_links.get(offer.port) or self.link_dirs[offer.identity]
                await self.engine.start_peer_send_files(
                    offer.host, offer.port, offer.world_size, [str(link_dir / s[0]) for s in offer.specs],
                    offer.backend, timeout_s=PEER_JOIN_TIMEOUT_S, external_store=offer.store_hosted,
                )
            else:
                await self.engine.start_peer_stage_send(
                    offer.host, offer.port, offer.world_size, [s[0] for s in offer.specs], offer.backend,
                    timeout_s=PEER_JOIN_TIMEOUT_S, external_store=offer.store_hosted,
                )
            return int((await self.engine.wait_job("send"))["bytes"])
        finally:
            self.peer_store = None  # the group is formed (or failed): its store is done

    async def drop_peer_stage(self) -> None:
        """Undo a stage that was never committed (a canceled walk): the host copy goes back to
        what the engine serves, and the engine drops its staged tensors. Waits for the host
        copy to have adopted the last swap first (`settled`), so a step that starts here may
        use the host copy and the stage arena."""
        await self.settled()
        stage, self.peer_stage = self.peer_stage, None
        if stage is None:
            return
        if stage.staged is not None:
            self.host.restore(stage.staged.backups)
            if stage.staged.path is not None:
                stage.staged.path.unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            await self.engine.discard_staged()

    async def stage_from_peer(self, offer: PeerOffer, rank: int) -> StageFromPeerResult:
        """Join the offer's group as `rank`, receive and check the tensors into an engine stage
        and a host-side copy; the engine keeps serving its current weights."""
        from snapshots.errors import ChainError

        if offer.base_identity != "*" and self.current_identity != offer.base_identity:
            raise ChainError(
                f"replica {self.name} serves {self.current_identity!r}; the offer completes {offer.base_identity!r}"
            )
        t0 = time.perf_counter()
        await self.drop_peer_stage()  # settles the host copy first
        if offer.mode == "files":
            return await self._stage_files_from_peer(offer, rank, t0)
        self.staging.mkdir(parents=True, exist_ok=True)
        path = self.staging / f"peer-{offer.identity}.safetensors"
        try:
            await self.engine.start_peer_stage_receive(
                offer.identity, offer.host, offer.port, rank, offer.world_size, offer.specs,
                expected_adler32=offer.expected_adler32, save_path=path, backend=offer.backend,
                timeout_s=PEER_JOIN_TIMEOUT_S, external_store=offer.store_hosted,
            )
            got = await self.engine.wait_job("stage")
            # The host copy takes the same bytes the engine checked (no bucket reads).
            received = await asyncio.to_thread(_read_raw, path)
        except Exception as exc:
            raise EngineUpdateError(f"receiving from {offer.source_replica} failed; previous weights kept: "
                                    f"{one_line(exc)}") from None
        finally:
            path.unlink(missing_ok=True)
        wrong = await asyncio.to_thread(_adler_mismatches, received, offer.expected_adler32)
        if wrong:
            await self.engine.discard_staged()
            raise EngineUpdateError(f"received bytes differ from the sender's checksums for {', '.join(wrong[:5])}")
        self.peer_stage = PeerStage(offer=offer, received=received)
        return StageFromPeerResult(identity=offer.identity, tensors_staged=int(got["tensors"]),
                                   bytes_received=int(got["bytes"]), stage_ms=_ms_since(t0))

    async def _stage_files_from_peer(self, offer: PeerOffer, rank: int, t0: float) -> StageFromPeerResult:
        """Receive a delta link's files from a peer, then stage them exactly like the bucket
        path does (host copy first, every changed tensor's Adler-32 checked, then the engine)."""
        from snapshots.errors import ChainError

        chain_ids = [link.identity for link in offer.chain]
        if self.applied != chain_ids[:-1]:
            raise ChainError(f"replica {self.name} serves {self.current_identity!r}; the delta from "
                             f"{offer.source_replica} applies to {chain_ids[-2]!r}")
        await asyncio.to_thread(self.clear_links)
        link_dir = self.links_root / offer.identity
        # Receivers on this host decode in rank order, the order they commit in.
        turn = (str(offer.port), rank)
        marker = decode_turn_marker(self.arena.directory, *turn)
        try:
            return await self._receive_and_stage_files(offer, rank, t0, link_dir, turn)
        finally:
            marker.unlink(missing_ok=True)

    async def _receive_and_stage_files(
        self, offer: PeerOffer, rank: int, t0: float, link_dir: Path, turn: tuple[str, int]
    ) -> StageFromPeerResult:
        try:
            await self.engine.start_peer_receive_files(
                offer.host, offer.port, rank, offer.world_size, offer.specs, offer.expected_adler32,
                link_dir, offer.backend, timeout_s=PEER_JOIN_TIMEOUT_S, external_store=offer.store_hosted,
            )
            got = await self.engine.wait_job("receive")
        except Exception as exc:
            raise EngineUpdateError(f"receiving from {offer.source_replica} failed; previous weights kept: "
                                    f"{one_line(exc)}") from None
        log.info("received %s's delta files from %s: %d bytes, joined in %.0f ms, transfer %.0f ms, %.0f ms "
                 "since the step began", offer.identity, offer.source_replica, int(got["bytes"]),
                 1000 * float(got.get("join_s", 0)), 1000 * float(got.get("transfer_s", 0)), _ms_since(t0))
        inp = ApplySnapshotInput(hot_load_id="", identity=offer.identity, chain=offer.chain, bucket="", path_prefix="")
        staged = await self.stage_update(inp, {offer.identity: link_dir}, turn)
        self.peer_stage = PeerStage(offer=offer, received=None, staged=staged)
        return StageFromPeerResult(identity=offer.identity, tensors_staged=len(staged.names),
                                   bytes_received=int(got["bytes"]), stage_ms=_ms_since(t0))

    async def commit_peer_stage(self, identity: str, policy: PromptCachePolicy) -> ApplySnapshotResult:
        """Swap a peer stage in (one short pause), then move the host copy and prove it."""
        from snapshots.errors import ChainError

        await self.settled()
        stage = self.peer_stage
        if stage is None or stage.offer.identity != identity:
            await self.drop_peer_stage()
            raise ChainError(f"replica {self.name} has no stage for {identity!r}")
        self.peer_stage = None
        offer = stage.offer
        if offer.base_identity != "*" and self.current_identity != offer.base_identity:
            self.peer_stage = stage
            await self.drop_peer_stage()
            raise ChainError(f"replica {self.name} serves {self.current_identity!r}; the stage completes "
                             f"{offer.base_identity!r}")
        t0 = time.perf_counter()
        if stage.staged is not None:  # a delta link received as files, staged like the bucket path
            staged = stage.staged
            pause_ms, prove_ms, verified = await self._swap_in(staged, [link.identity for link in offer.chain], policy)
            log.info("applied %s from %s (delta files): %s", identity, offer.source_replica,
                     _fmt({"pause": pause_ms, "prove": prove_ms, "total": _ms_since(t0)}))
            return ApplySnapshotResult(
                identity=identity, engine_pid=self.engine.pid, tensors_loaded=len(staged.names),
                bytes_read_from_bucket=0, pause_ms=pause_ms, source=f"peer:{offer.source_replica}",
                verified_tensors=verified, links_applied=staged.links,
            )
        names_ = [s[0] for s in offer.specs]
        saved = self.host.save(names_)
        self.host.restore(stage.received, checksums=offer.expected_adler32)  # verified at staging
        pause_ms, swap = await self._swap_staged(identity, saved, names_, policy)
        chain_ids = self._commit_offer(offer, names_)
        verified = int(swap["verified"])
        log.info("applied %s from %s: %s", identity, offer.source_replica,
                 _fmt({"pause": pause_ms, "total": _ms_since(t0)}))
        return ApplySnapshotResult(
            identity=identity, engine_pid=self.engine.pid, tensors_loaded=len(names_),
            bytes_read_from_bucket=0, pause_ms=pause_ms, source=f"peer:{offer.source_replica}",
            verified_tensors=verified, links_applied=chain_ids,
        )


def _ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 1)


def _fmt(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f} ms" for k, v in timings.items())

@dataclass
class PeerStage:
    """Tensors received from a peer and checked, staged in the engine and held for the host
    copy; nothing the engine serves has changed yet."""

    offer: PeerOffer
    received: dict[str, np.ndarray] | None  # tensors as served (mode "tensors")
    staged: StagedUpdate | None = None  # a delta link staged on the host copy (mode "files")


class EngineUpdateError(RuntimeError):
    """The engine could not take an update; it serves exactly its previous weights."""


def _file_adler32(path: Path) -> str:
    from snapshots.codec import adler32

    value = 1
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            value = adler32(chunk, value)
    return "%08x" % (value & 0xFFFFFFFF)


def _adler_mismatches(arrays: dict[str, np.ndarray], expected: dict[str, str]) -> list[str]:
    from snapshots.codec import adler32_hex

    return [n for n, a in arrays.items() if adler32_hex(a) != expected.get(n, "").lower()]


def _read_raw(path: Path) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file as flat byte arrays (the host copy's representation)."""
    import torch
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            out[key] = f.get_tensor(key).contiguous().view(-1).view(torch.uint8).numpy().copy()
    return out


# ---------------------------------------------------------------------- process
def download_prefix(s3: Any, bucket: str, prefix: str, dest: Path) -> int:
    """Copy the top-level objects under `prefix/` into `dest`; returns bytes downloaded."""
    dest.mkdir(parents=True, exist_ok=True)
    prefix = prefix.strip("/") + "/"
    total = 0
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix):]
            if not name or "/" in name:
                continue
            target = dest / name
            if not target.exists() or target.stat().st_size != obj["Size"]:
                tmp = target.with_suffix(target.suffix + ".part")
                s3.download_file(bucket, obj["Key"], str(tmp))
                tmp.replace(target)
                total += obj["Size"]
    if not any(dest.iterdir()):
        raise FileNotFoundError(f"no objects under s3://{bucket}/{prefix}")
    return total


async def run_replica(
    settings: Settings,
    *,
    deployment_id: str,
    name: str,
    workflow_id: str,
    zone: str,
    model_bucket: str,
    model_path: str,
    model_name: str,
    catch_up: str | None = None,
    engine_config: dict[str, str] | None = None,
) -> int:
    from temporalio.worker import Worker

    from common.telemetry import setup_tracing, temporal_interceptors
    from replica.activities import PeerActivities, ReplicaActivities
    from replica.engine import EngineProcess
    from snapshots.host import HostWeights

    workdir = settings.home_path / "replicas" / deployment_id / name
    setup_tracing("rollouts-replica")
    client = await temporal_client(settings, interceptors=temporal_interceptors())
    deployment = client.get_workflow_handle(workflow_id)
    s3 = settings.s3_client()
    engine = None
    engine_pid_file = PidFile(workdir / "engine.pid")
    leftover = engine_pid_file.alive_pid()
    if leftover is not None:
        # An engine orphaned by a killed agent: it may sit paused forever. Stop it first.
        log.warning("stopping engine %d left by a previous run of %s", leftover, name)
        stop_pid(leftover, timeout=20)
    # Shared memory that killed engines (this replica's or others') left in /dev/shm.
    await asyncio.to_thread(reclaim_dead_segments)
    try:
        model_dir = workdir / "model"
        await asyncio.to_thread(download_prefix, s3, model_bucket, model_path, model_dir)
        port = free_port()
        engine = EngineProcess(
            model_dir,
            # vLLM binds IPC sockets under the engine's TMPDIR, and a socket path must stay under
            # 108 bytes: keep it short, outside the (possibly deep) stack home.
            work_dir=Path(tempfile.gettempdir()) / "rollouts-engines" / name,
            served_model_name=model_name,
            port=port,
            log_path=workdir / "engine.log",
            # What the gateway derives too: the engine answers only this agent and the gateway.
            secret=settings.engine_secret(workflow_id, name),
            **engine_options(engine_config or {}),
        )
        await engine.start()
        engine_pid_file.write(engine.pid)
        await engine.set_weight_version("initial")
        # The host copy lives in shared memory: the engine takes its roll-back bytes from it.
        host_arena = StageArena()
        host = await asyncio.to_thread(lambda: HostWeights.load(model_dir, allocate=host_arena.allocate))
        runtime = ReplicaRuntime(name=name, engine=engine, host=host, s3=s3, workdir=workdir, host_arena=host_arena)
        if catch_up:
            # A replica (re)started after hot-loads serves their snapshot before it takes traffic.
            inp = ApplySnapshotInput.model_validate_json(catch_up)
            result = await runtime.apply_from_bucket(inp)
            log.info("caught up to %s (%d tensors, %d bytes from the bucket)", inp.identity,
                     result.tensors_loaded, result.bytes_read_from_bucket)
    except Exception as exc:  # noqa: BLE001 - reported to the deployment, then exit
        log.exception("replica %s failed to start", name)
        await deployment.signal(
            "replica_failed", ReplicaFailure(name=name, reason=f"start failed: {one_line(exc)}; log {workdir}")
        )
        if engine is not None:
            await engine.stop()
        return 1

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task_queue = names.replica_task_queue(workflow_id, name)
    peer = PeerActivities(runtime)
    worker = Worker(
        client,
        task_queue=task_queue,
        activities=[
            ReplicaActivities(runtime).apply_snapshot, peer.offer_to_peer,
            peer.send_to_peers, peer.stage_from_peer, peer.commit_peer_stage,
        ],
        # Heartbeats carry cancellation back: send them at least every second, not every 24 s.
        max_heartbeat_throttle_interval=timedelta(seconds=1),
    )
    code = 0
    async with worker:
        now = rfc3339(datetime.now(UTC))
        await deployment.signal(
            "replica_ready",
            ReplicaEndpoint(
                name=name, zone=zone, task_queue=task_queue, engine_url=engine.base_url,
                engine_pid=engine.pid, agent_pid=os.getpid(), current_snapshot_identity=runtime.current_identity,
                started_at=now, transitioned_at=now,
            ),
        )
        log.info("replica %s ready: engine %s (pid %d), queue %s", name, engine.base_url, engine.pid, task_queue)
        while not stop.is_set():
            if not engine_alive(engine):
                reason = f"engine process {engine.pid} exited; log {engine.log_path}"
                log.error(reason)
                try:
                    await deployment.signal("replica_failed", ReplicaFailure(name=name, reason=reason))
                except Exception:  # noqa: BLE001
                    pass
                code = 1
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
    await engine.stop()
    engine_pid_file.remove()
    shutil.rmtree(runtime.staging, ignore_errors=True)
    return code
