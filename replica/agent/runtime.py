"""The replica's runtime: the all-or-nothing bookkeeping of every update of its engine.

`ReplicaRuntime` holds the engine, the host copy of the weights and the chain it serves. An
update is staged first, the engine serving (from the bucket here; from a peer's broadcast in
`replica.agent.peers`), then swapped in inside one short pause and proven there, then committed.
Delta links it fetched or received stay in `links_root` so that it can offer them to its peers.
Fault points (`replica.faults`) sit where a real failure of a step could happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import save_file
from temporalio.exceptions import ApplicationError

from contracts.activities import ApplySnapshotInput, ApplySnapshotResult
from contracts.engine_ranks import swap_bytes
from contracts.records import PromptCachePolicy, SnapshotRef, SnapshotType
from replica import faults
from replica.agent.downloads import download_prefix
from replica.agent.engine_control import EngineControl
from replica.agent.engine_rpc import ReadBackFailed
from replica.agent.host_decodes import Publication, copy_published, decode_key, publish, read_published
from replica.agent.metrics import delta_staged
from replica.agent.peers import PeerSteps
from replica.agent.staged import EngineUpdateError, PeerStage, StagedUpdate, fmt, ms_since, one_line
from replica.stage_arena import StageArena, host_decode_slot
from snapshots.errors import ChainError
from snapshots.host import HostWeights
from snapshots.inspect import read_delta_plan
from snapshots.storage import snapshot_uri

log = logging.getLogger("rollouts.replica")


def engine_parts(swap: dict[str, Any]) -> dict[str, float]:
    """The engine's own share of a swap, in ms, from its report: `swap_in` (copy and the CPU
    kernels' repack) and `prove` (the read-back)."""
    return {
        "swap_in": round(1000 * (float(swap.get("copy_s", 0.0)) + float(swap.get("repack_s", 0.0))), 3),
        "prove": round(1000 * float(swap.get("verify_s", 0.0)), 3),
    }


class ReplicaRuntime(PeerSteps):
    """State shared by the agent's activities: the engine, the host copy and what it serves.

    Every update is staged while the engine serves (refusing, before any pause, a tensor whose name,
    shape or dtype the engine cannot take), then swapped in and proven inside one short pause.
    Invariants: only a proven swap commits the chain; a failure at any point leaves the engine, its
    label and the host copy exactly as they were, and the error says what was read back to show it;
    the host copy adopts a commit's bytes on a thread and every later step waits for that first
    (`settled`).
    """

    def __init__(
        self,
        *,
        name: str,
        engine: EngineControl,
        host: Any,
        s3: Any,
        workdir: Path,
        peer_host: str = "127.0.0.1",
        peer_backend: str = "gloo",
        host_arena: StageArena | None = None,
        faults_home: Path | None = None,
        deployment: str = "",
    ) -> None:
        self.name = name
        self.deployment = deployment
        # Where `faults.json` may arm fault points (the stack's home); None: no fault points.
        self.faults_home = faults_home
        # Set when the running step's activity is canceled (`replica.agent.activities`): a
        # fault point's hold ends then, as the step itself cannot be interrupted mid-swap.
        self.step_canceled = asyncio.Event()
        self.engine = engine
        self.host = host
        # The shared memory `host` lives in (None: private memory): the engine's roll-back
        # copies of a delta stage are views of it (`replica.stage_arena`).
        self.host_arena = host_arena
        self.s3 = s3
        self.workdir = workdir
        self.staging = workdir / "staging"
        # The node address: the host of this replica's peer offers, where receivers connect.
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
        # The record that offers the arena's last decode to the host's other replicas.
        self.decode_published: Publication | None = None
        # The rendezvous stores this replica hosts for its offers, by port, until each one's send.
        self.peer_stores: dict[int, Any] = {}
        self._adopting: asyncio.Future[None] | None = None  # the host copy taking the last swap
        # Per hot-load id: resolves with the bucket update's stage once it is checked (an early
        # offer waits on it), or fails if the update ended without one.
        self.update_stages: dict[str, asyncio.Future[StagedUpdate]] = {}
        self.offered_links: dict[int, Path] = {}  # files offered to peers, by the offer's port
        # The last delta link staged from a peer as files, kept through its commit: the replica
        # passes it on (`make_offer_from_stage`) whether or not it swapped it in yet.
        self.stage_passed_on: PeerStage | None = None

    @property
    def current_identity(self) -> str:
        return self.applied[-1]

    def fault_armed(self, point: str) -> bool:
        """Whether `faults.json` arms `point` for this replica (one `stat` when there is none)."""
        return self.faults_home is not None and faults.armed(
            self.faults_home, point, replica=self.name, deployment=self.deployment
        )

    async def fault(self, point: str) -> None:
        """Fire `point` if `faults.json` arms it for this replica (`replica.faults`): a "fail"
        raises its non-retryable ApplicationError; a "hold" waits, and ends when the step is
        canceled (then EngineUpdateError: the step stops where it stood)."""
        if self.faults_home is None:
            return
        if await faults.hit(
            self.faults_home, point, replica=self.name, deployment=self.deployment, until=self.step_canceled
        ):
            raise EngineUpdateError(f"the step was canceled while held at the fault point {point}")

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
        self,
        inp: ApplySnapshotInput,
        local_links: dict[str, Path] | None = None,
        turn: tuple[str, int] | None = None,
        decoded: Callable[[StagedUpdate], None] | None = None,
    ) -> StagedUpdate:
        """Stage an update for the engine, off the serving path; the host copy is not changed.

        Delta links are decoded once into the stage arena (Adler-32 checked) and the engine stages
        views of it; a new full base goes through a staging file. ``decoded`` is called once the delta
        files are decoded and checked, before the engine stages them (the early offer's moment).
        """
        todo = self.missing_links(inp)
        local = local_links or {}
        if todo and all(link.identity in local for link in todo):
            t_wait = time.perf_counter()
            # The slot is this host's one decode at a time; the engine's stage of the decoded
            # bytes runs after it, while the host's next replica copies this decode.
            async with host_decode_slot(self.arena.directory, turn):
                t0 = time.perf_counter()
                staged = await asyncio.to_thread(self.decode_links, inp, todo, local)
                t1 = time.perf_counter()
            if decoded is not None:
                decoded(staged)
            entries = [
                [n, self.host.info(n).torch_dtype, list(self.host.info(n).shape), offset]
                for n, offset in staged.arena_offsets.items()
            ]
            try:
                # The decode just checked these bytes; the commit checks what the engine holds.
                job = await self.engine.stage_from_arena(
                    staged.identity,
                    self.arena.path,
                    entries,
                    staged.expected,
                    verify=False,
                    backup=self._host_backup(staged.names),
                )
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await self.engine.discard_staged()
                raise EngineUpdateError(
                    f"the engine could not stage the update; it serves its previous weights: {one_line(exc)}"
                ) from None
            log.info(
                "staged %s: waited %.0f ms for the host's decode slot, %s %.0f ms, engine stage %.0f ms (%s)",
                staged.identity,
                (t0 - t_wait) * 1000,
                "copy of the host's decode" if staged.copied_from else "decode",
                (t1 - t0) * 1000,
                ms_since(t1),
                fmt({k: 1000 * float(v) for k, v in job.items() if k.endswith("_s") or k == "seconds"}),
            )
            return staged
        staged = await asyncio.to_thread(self.stage_chain, inp, local)
        if staged.nothing_to_do:
            return staged
        try:
            await self.engine.stage_from_files(
                staged.identity, [str(staged.path)], staged.names, expected_adler32=staged.expected
            )
        except Exception as exc:
            staged.path.unlink(missing_ok=True)  # type: ignore[union-attr]
            raise EngineUpdateError(
                f"the engine could not stage the update; it serves its previous weights: {one_line(exc)}"
            ) from None
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

    def withdraw_decode(self) -> None:
        """Stop offering the arena's last decode to the host's other replicas: before the arena
        is written again, and when the agent stops."""
        if self.decode_published is not None:
            self.decode_published.withdraw()
            self.decode_published = None

    def decode_links(self, inp: ApplySnapshotInput, todo: list[SnapshotRef], local: dict[str, Path]) -> StagedUpdate:
        """Decode the missing delta links (local directories) into the stage arena, in chain
        order, against the host copy (which does not change); each link's tensors are checked
        against their recorded Adler-32. A checked decode of the same links on the same weights
        that this host published is copied instead, before any delta plan is read
        (`replica.agent.host_decodes`). Raises SnapshotError naming file and tensor."""
        ids = [link.identity for link in todo]
        key = decode_key(self.applied, ids, [Path(local[i]) for i in ids])
        staged = StagedUpdate(identity=inp.identity)
        self.withdraw_decode()  # before the arena is written again
        if not self._copy_host_decode(key, ids, staged):
            self._decode_here(key, todo, local, staged)
        for link in todo:
            staged.links.append(link.identity)
            staged.link_dirs[link.identity] = Path(local[link.identity])
        return staged

    def _decode_here(self, key: str, todo: list[SnapshotRef], local: dict[str, Path], staged: StagedUpdate) -> None:
        """:meth:`decode_links`' own decode; publishes it for this host's other replicas."""
        plans = [read_delta_plan(local[link.identity]) for link in todo]
        sizes: dict[str, int] = {}
        for plan in plans:
            for name in plan.tensors:
                if name in self.host and name not in sizes:
                    sizes[name] = self.host.info(name).nbytes
        layout = self.arena.reserve(list(sizes.items()))
        out = {n: self.arena.view(offset, nbytes) for n, (offset, nbytes) in layout.items()}
        decoded: set[str] = set()
        for link, plan in zip(todo, plans):
            report = self.host.decode_delta_into(plan, out, decoded)
            decoded.update(report.changed)
            staged.expected.update(report.checksums)
            staged.changed_by_link[link.identity] = list(report.changed)
        if out:
            delta_staged(self.deployment, self.name, copied=False)
        self._hold_decoded(staged, out, layout, decoded)
        if decoded:
            self.decode_published = publish(
                self.arena.directory,
                key,
                self.arena.path,
                self.arena.size,
                {n: (*layout[n], staged.expected[n]) for n in staged.names},
                {link: list(names or []) for link, names in staged.changed_by_link.items()},
            )

    @staticmethod
    def _hold_decoded(
        staged: StagedUpdate, out: dict[str, np.ndarray], layout: dict[str, tuple[int, int]], names: set[str]
    ) -> None:
        staged.names = sorted(names)
        staged.decoded = {n: out[n] for n in staged.names}
        staged.arena_offsets = {n: layout[n][0] for n in staged.names}

    def _copy_host_decode(self, key: str, ids: list[str], staged: StagedUpdate) -> bool:
        """Fill the stage arena with another replica's checked decode of the same update on the
        same weights, when this host has one (`replica.agent.host_decodes`); False: decode here."""
        t0 = time.perf_counter()
        published = read_published(self.arena.directory, key)
        if published is None or set(published.changed) != set(ids):
            return False
        for name, (_, nbytes) in published.places.items():
            if name not in self.host or self.host.info(name).nbytes != nbytes:
                return False  # the decode here names what does not fit
        in_order = sorted(published.places, key=lambda n: published.places[n][0])
        layout = self.arena.reserve([(n, published.places[n][1]) for n in in_order])
        source = copy_published(published, self.arena.view(0, self.arena.size), layout, workers=self.host.workers)
        if source is None:
            return False
        out = {n: self.arena.view(offset, nbytes) for n, (offset, nbytes) in layout.items()}
        staged.expected.update(published.checksums)
        staged.changed_by_link.update({link: list(names) for link, names in published.changed.items()})
        staged.copied_from = source
        self._hold_decoded(staged, out, layout, set(out))
        delta_staged(self.deployment, self.name, copied=True)
        log.info(
            "%s: copied this host's decode of %s from %s and checked it: %d tensors, %.0f ms",
            self.name,
            staged.identity,
            source,
            len(out),
            ms_since(t0),
        )
        return True

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
            raise EngineUpdateError(
                f"the host copy could not take the last update: {one_line(exc)}; restart the replica"
            ) from None
        if self._adopting is adopting:
            self._adopting = None

    def stage_chain(self, inp: ApplySnapshotInput, local_links: dict[str, Path] | None = None) -> StagedUpdate:
        """Load the chain's full base as a new host copy, apply its delta links and write every tensor to
        a staging file; neither the engine nor the current host copy is touched. A delta link comes
        from `local_links` when given, else it is downloaded into `links_root` (kept for peers).
        """
        if self.applied == [link.identity for link in inp.chain]:
            return StagedUpdate(nothing_to_do=True)
        if not inp.chain or inp.chain[0].type != SnapshotType.FULL:
            raise ChainError("the snapshot chain must start with a full snapshot")
        staged = StagedUpdate(new_host_arena=StageArena())
        base = inp.chain[0]
        target = HostWeights.load(
            snapshot_uri(inp.bucket, inp.path_prefix, base.identity),
            s3=self.s3,
            allocate=staged.new_host_arena.allocate,
        )
        staged.new_host = target
        staged.bytes_read += target.total_bytes
        staged.links.append(base.identity)
        staged.changed_by_link[base.identity] = None
        for link in inp.chain[1:]:
            location = (local_links or {}).get(link.identity)
            if location is None:
                location = self.links_root / link.identity
                prefix = "/".join(p for p in (inp.path_prefix.strip("/"), link.identity) if p)
                staged.bytes_read += download_prefix(self.s3, inp.bucket, prefix, location)
            staged.changed_by_link[link.identity] = list(target.apply_delta(read_delta_plan(location)))
            staged.links.append(link.identity)
            staged.link_dirs[link.identity] = Path(location)
        staged.identity = inp.identity
        staged.names = sorted(target.names())
        staged.expected = target.checksums()
        staged.path = self._write_staging(target, staged.names, inp.identity)
        return staged

    def _write_staging(self, host: Any, names_: list[str], label: str) -> Path:
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
        ready = self.update_stage(inp.hot_load_id, fresh=True)
        try:
            return await self._apply_from_bucket(inp, ready)
        finally:
            if not ready.done():
                ready.set_exception(
                    ChainError(
                        f"replica {self.name}'s update to {inp.identity} ended before it staged anything to offer"
                    )
                )
                ready.exception()  # retrieved: nobody may be waiting

    async def _apply_from_bucket(
        self, inp: ApplySnapshotInput, ready: asyncio.Future[StagedUpdate]
    ) -> ApplySnapshotResult:
        await self.fault("apply_snapshot")
        t0 = time.perf_counter()
        await self.drop_peer_stage()  # settles the host copy first
        if self.applied != [link.identity for link in inp.chain]:  # else its links stay offerable
            await asyncio.to_thread(self.clear_links)
        todo = self.missing_links(inp) or []
        local, fetched = await asyncio.to_thread(self.fetch_links, inp, todo)
        timings = {"fetch": ms_since(t0)}
        t1 = time.perf_counter()

        def offer(staged: StagedUpdate) -> None:  # its delta files are checked: peers may take them
            if not ready.done():
                ready.set_result(staged)

        staged = await self.stage_update(inp, local, decoded=offer)
        timings["stage"] = ms_since(t1)
        if not ready.done():
            ready.set_result(staged)  # checked and staged: peers may take its files from here on
        if staged.nothing_to_do:
            verified = await self.prove(self.host.names())
            return ApplySnapshotResult(
                identity=inp.identity,
                engine_pid=self.engine.pid,
                tensors_loaded=0,
                bytes_read_from_bucket=0,
                pause_ms=0.0,
                stage_ms=timings["stage"],
                verified_tensors=verified,
            )
        pause_ms, prove_ms, verified, breakdown, moved = await self._swap_in(
            staged, [link.identity for link in inp.chain], inp.prompt_cache_policy
        )
        timings.update(pause=pause_ms, prove=prove_ms, total=ms_since(t0))
        log.info("applied %s from the bucket: %s", inp.identity, fmt(timings))
        return ApplySnapshotResult(
            identity=inp.identity,
            engine_pid=self.engine.pid,
            tensors_loaded=len(staged.names),
            bytes_read_from_bucket=staged.bytes_read + fetched,
            pause_ms=pause_ms,
            links_applied=staged.links,
            stage_ms=timings["fetch"] + timings["stage"],
            source="bucket",
            verified_tensors=verified,
            pause_breakdown_ms=breakdown,
            swap_bytes=moved,
        )

    async def _swap_in(
        self, staged: StagedUpdate, chain_ids: list[str], policy: PromptCachePolicy
    ) -> tuple[float, float, int, dict[str, float], dict[str, int]]:
        """Swap a stage in and prove it (one pause), then commit the chain and start the host
        copy's adoption; returns (pause ms, ms of the proof inside it, tensors proven, where the
        pause went, the bytes it moved)."""
        try:
            pause_ms, swap = await self._swap_staged(staged.identity, {}, staged.names, policy)
        finally:
            if staged.path is not None:
                staged.path.unlink(missing_ok=True)
        self._adopt_later(staged)
        self._commit(chain_ids, staged.new_host, staged.changed_by_link, staged.new_host_arena)
        self.link_dirs = staged.link_dirs
        return (
            pause_ms,
            1000 * float(swap.get("verify_s", 0.0)),
            int(swap["verified"]),
            swap["breakdown_ms"],
            swap_bytes(swap),
        )

    async def _swap_staged(
        self, label: str, host_backups: dict[str, np.ndarray], names_: list[str], policy: PromptCachePolicy
    ) -> tuple[float, dict[str, Any]]:
        """Have the engine swap its stage in (`replica.engine.swap`: one call, the transaction
        inside its own process); on a failure restore the host copy and say what the engine
        serves. The "swap" fault point, when armed, runs while the engine holds after its write.
        Returns the pause in ms (the engine's ``window``) and its report (``breakdown_ms``: where
        the pause went, with ``call``, the whole call as the agent saw it). A read-back that
        differs raises ReadBackFailed naming the tensors; an injected fault keeps its type."""
        # RESET_ALL: clear the KV cache at the pause, so paused requests are recomputed on the new
        # weights after the resume and no prefix computed under the old ones is reused.
        reset = policy == PromptCachePolicy.RESET_ALL
        try:
            await self.fault("pause")
            t0 = time.perf_counter()
            swap = await self.engine.swap_in_pause(
                label,
                self.current_identity,
                clear_cache=reset,
                expected=len(names_),
                while_held=(lambda: self.fault("swap")) if self.fault_armed("swap") else None,
            )
        except Exception as exc:
            # The engine's tensors and label are back (its swap is all-or-nothing); the host copy here.
            self.host.restore(host_backups)
            kept = await self._kept_previous(names_)
            if isinstance(exc, ApplicationError):  # an injected fault: its type and retry policy stand
                raise ApplicationError(
                    f"{exc.message}; {kept}", type=exc.type, non_retryable=exc.non_retryable
                ) from None
            if isinstance(exc, ReadBackFailed):
                raise ReadBackFailed(
                    f"the engine's read-back inside the pause differs from the snapshot for "
                    f"{', '.join(exc.tensors[:8])}; {kept}",
                    exc.tensors,
                ) from None
            raise EngineUpdateError(
                f"loading {len(names_)} tensor(s) into the engine failed; {kept}: {one_line(exc)}"
            ) from None
        timings = {**swap.pop("timings_ms"), **engine_parts(swap), "call": ms_since(t0)}
        log.info("swap of %d tensor(s) in the pause: %s", len(names_), fmt(timings))
        swap["breakdown_ms"] = timings
        return float(timings["window"]), swap

    async def _kept_previous(self, names_: list[str]) -> str:
        """After a refused swap: read back what the engine serves (label and the swapped
        tensors) against the host copy, and say so."""
        try:
            label = await self.engine.weight_version()
            await self.prove(names_)
        except Exception as exc:  # noqa: BLE001 - reported in the replica's error
            return (
                f"the engine could not be shown to serve its previous weights ({one_line(exc, 200)}); "
                f"restart the replica"
            )
        if label != self.current_identity:
            return f"the engine serves its previous weights but is labelled {label!r}; restart the replica"
        return f"it serves its previous weights ({self.current_identity}, {len(names_)} tensor(s) read back)"

    def _commit(
        self,
        chain_ids: list[str],
        new_host: Any,
        changed: dict[str, list[str] | None],
        new_host_arena: StageArena | None = None,
    ) -> None:
        if new_host is not None:
            self.host = new_host
            self.host_arena = new_host_arena
            self.changed_by_link = {}
        self.changed_by_link.update(changed)
        self.applied = list(chain_ids)

    async def prove(self, names_: list[str]) -> int:
        """Compare the Adler-32 of what the engine serves for `names_` (computed now, on its
        background thread) with the host copy's verified ones; EngineUpdateError naming the
        tensors that differ. (A swap is proven inside its pause instead: `_swap_staged`.)"""
        if not names_:
            return 0
        served = await self.engine.served_shards(names_)
        # A tensor-parallel engine's shards are compared with the same regions of the host copy.
        wrong = served.differing(names_, self.host.checksums(), self.host.tensor)
        if wrong:
            raise EngineUpdateError(
                f"served weights differ from the snapshot for {len(wrong)} tensor(s): {', '.join(wrong[:5])}"
            )
        return len(names_)
