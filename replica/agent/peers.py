"""Weights passed replica to replica: offers, the send to a transfer group, and a receiver's stage
and commit (`PeerSteps`, mixed into `replica.agent.runtime.ReplicaRuntime`).

A sender offers what receivers serving ``target_identity`` miss: a delta link's checked files
(early, before its own swap, or passed on by a receiver that staged them), else the changed
tensors it serves, else everything; it holds an offer's files as hard links until the send,
and hosts one rendezvous store per offer on every address of its host (``peer_host``: its node
address). `send_to_peers` broadcasts from its engine over gloo, or NCCL where the operator opts
in (:func:`peer_backend`), while every engine keeps serving. Invariants: a receiver checks
everything against the sender's Adler-32 before staging, reads nothing from the bucket, and
swaps in only at its commit (`commit_peer_stage`, one short pause with the proof).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from common import envs
from common.processes import free_port
from contracts.activities import (
    ApplySnapshotInput,
    ApplySnapshotResult,
    PeerOffer,
    PeerOfferInput,
    StageFromPeerResult,
)
from contracts.engine_ranks import swap_bytes
from contracts.records import PromptCachePolicy
from replica.agent.staged import (
    EngineUpdateError,
    PeerStage,
    adler_mismatches,
    file_adler32,
    fmt,
    ms_since,
    one_line,
    read_raw,
)
from replica.peer_join import PeerJoin
from replica.stage_arena import decode_turn_marker
from snapshots.errors import ChainError

log = logging.getLogger("rollouts.replica")
# Joining a peer group blocks the engine until the other side joins: keep the wait short.
PEER_JOIN_TIMEOUT_S = 30.0
PEER_BACKEND_ENV = envs.ROLLOUTS_PEER_BACKEND.name
# Offers whose send never came (the walk ended first) keep their files until this many newer ones.
OFFERS_KEPT = 8


def peer_backend(environ: Mapping[str, str]) -> str:
    """What this replica's engine broadcasts to its peers over, from ``ROLLOUTS_PEER_BACKEND``
    (the node agent's environment): ``gloo`` (the default, CPU and GPU engines alike: CPU bytes
    over the node network) or ``nccl`` (a replica placed on GPUs; every replica of a deployment
    must say the same, so set it on every node agent). Either carries a delta link's files or
    the tensors themselves. ValueError naming the variable otherwise."""
    value = envs.ROLLOUTS_PEER_BACKEND.get(environ)
    if value == "nccl" and not environ.get("CUDA_VISIBLE_DEVICES"):
        raise ValueError(
            f"{PEER_BACKEND_ENV}=nccl needs a replica placed on GPUs (its node agent gave it no CUDA_VISIBLE_DEVICES)"
        )
    return value


def _join(offer: PeerOffer, rank: int = 0) -> PeerJoin:
    """This engine's place, as ``rank`` (0: the sender), in the group ``offer`` describes."""
    return PeerJoin(
        offer.host,
        offer.port,
        offer.world_size,
        rank,
        offer.backend,
        timeout_s=PEER_JOIN_TIMEOUT_S,
        external_store=offer.store_hosted,
    )


class PeerSteps:
    """The peer steps of `ReplicaRuntime` (module docstring); they use its state and its swap."""

    def make_offer(self, inp: PeerOfferInput) -> PeerOffer:
        """What this replica would send to replicas serving `inp.target_identity`; with
        `inp.host_store`, it also starts hosting the group's rendezvous store (until its send)."""
        return self._hosting_store(inp, self._build_offer(inp))

    def _hosting_store(self, inp: PeerOfferInput, offer: PeerOffer) -> PeerOffer:
        """With `inp.host_store`, start hosting the offer's rendezvous store (until the send)."""
        if not inp.host_store:
            return offer
        # Up before any engine connects: a TCPStore client that finds no master backs off for
        # ~0.7 s, which every member of the group would then wait out.
        # One store per offer (its port): a sender may hold several offers until each is sent.
        self.peer_stores[offer.port] = TCPStore(
            offer.host,
            offer.port,
            offer.world_size,
            is_master=True,
            timeout=timedelta(seconds=PEER_JOIN_TIMEOUT_S),
            wait_for_workers=False,
        )
        while len(self.peer_stores) > OFFERS_KEPT:  # offers the walk never sent
            self.peer_stores.pop(next(iter(self.peer_stores)))
        return offer.model_copy(update={"store_hosted": True})

    async def make_offer_from_stage(self, inp: PeerOfferInput, wait_s: float = 600.0) -> PeerOffer:
        """The early offer (`inp.from_stage`): offer the delta link's checked files of `inp.hot_load_id`
        to receivers serving its base, before this replica swaps them in (or what it serves, once it
        serves the update). Raises ChainError when the update has no such files (a new base).
        """
        chain_ids = [link.identity for link in inp.chain]
        if self.applied == chain_ids:
            return self.make_offer(inp)
        # A stage being swapped in still passes on: its files stay until the next update.
        stage = self.peer_stage or self.stage_passed_on
        if stage is not None and stage.offer.identity == inp.identity:
            link_dir = self.links_root / inp.identity
            if not (
                stage.staged is not None
                and stage.offer.mode == "files"
                and inp.accept_files
                and len(chain_ids) > 1
                and inp.target_identity == chain_ids[-2]
                and link_dir.is_dir()
            ):
                raise ChainError(
                    f"replica {self.name}'s stage of {inp.identity!r} from a peer holds no delta "
                    f"files for replicas on {inp.target_identity!r}"
                )
            return self._hosting_store(inp, await asyncio.to_thread(self._files_offer, inp, link_dir))
        if inp.peer_stage:
            raise ChainError(
                f"replica {self.name} holds no stage of {inp.identity!r} from a peer to pass on "
                f"(it serves {self.current_identity!r})"
            )
        try:
            staged = await asyncio.wait_for(asyncio.shield(self.update_stage(inp.hot_load_id)), wait_s)
        except TimeoutError:
            raise ChainError(f"replica {self.name} staged nothing for {inp.identity!r} in {wait_s:.0f} s") from None
        link_dir = staged.link_dirs.get(chain_ids[-1])
        if not (
            inp.accept_files
            and staged.identity == inp.identity
            and len(chain_ids) > 1
            and inp.target_identity == chain_ids[-2]
            and staged.arena_offsets
            and link_dir is not None
            and link_dir.is_dir()
        ):
            raise ChainError(
                f"replica {self.name}'s update to {inp.identity!r} holds no delta files for "
                f"replicas on {inp.target_identity!r} to take before its swap"
            )
        return self._hosting_store(inp, await asyncio.to_thread(self._files_offer, inp, link_dir))

    def _files_offer(self, inp: PeerOfferInput, link_dir: Path) -> PeerOffer:
        """Offer a delta link's files (checked by this replica's decode) as they are. The offer
        holds its own hard links to them (`offers_root`/port) until its send: the next update
        clears `links_root`, and a send that finds no files would leave its receivers waiting
        for the group's timeout."""
        port = free_port(self.peer_host)
        held = self._hold_files(link_dir, port)
        files = sorted(f for f in held.iterdir() if f.is_file())
        offer = PeerOffer(
            source_replica=self.name,
            host=self.peer_host,
            port=port,
            backend=self.peer_backend,
            base_identity=inp.target_identity,
            identity=inp.identity,
            chain=inp.chain,
            specs=[[f.name, "uint8", [f.stat().st_size]] for f in files],
            expected_adler32={f.name: file_adler32(f) for f in files},
            world_size=inp.world_size,
            mode="files",
        )
        self.offered_links[port] = held  # until its send
        while len(self.offered_links) > OFFERS_KEPT:  # offers the walk never sent
            shutil.rmtree(self.offered_links.pop(next(iter(self.offered_links))), ignore_errors=True)
        return offer

    @property
    def offers_root(self) -> Path:
        """Files offered to peers, one directory per offer (its port), until the offer's send."""
        return self.staging / "offers"

    def _hold_files(self, link_dir: Path, port: int) -> Path:
        """Hard links (a copy where the filesystem has none) to `link_dir`'s files, for one offer."""
        held = self.offers_root / str(port)
        shutil.rmtree(held, ignore_errors=True)
        held.mkdir(parents=True)
        for f in link_dir.iterdir():
            if f.is_file():
                try:
                    os.link(f, held / f.name)
                except OSError:
                    shutil.copyfile(f, held / f.name)
        return held

    def _build_offer(self, inp: PeerOfferInput) -> PeerOffer:
        chain_ids = [link.identity for link in inp.chain]
        if self.applied != chain_ids:
            raise ChainError(f"replica {self.name} serves {self.current_identity!r}, not {inp.identity!r}")
        link_dir = self.link_dirs.get(chain_ids[-1])
        if (
            inp.accept_files
            and len(chain_ids) > 1
            and inp.target_identity == chain_ids[-2]
            and link_dir is not None
            and link_dir.is_dir()
        ):
            # The receivers miss exactly the link this replica holds as files: send the delta
            # itself (the changed tensors, XOR+zstd, ~5 % of their bytes for an RL step) rather
            # than the tensors as served; each receiver decodes and checks it against its own copy.
            return self._files_offer(inp, link_dir)
        if self.engine.ranks > 1:
            # Each rank holds a shard: the tensors as served are in no one place to send.
            raise ChainError(
                f"replica {self.name}'s engine runs {self.engine.ranks} tensor-parallel ranks: it "
                f"offers a delta's files only, and replicas on {inp.target_identity!r} read the bucket"
            )
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
            source_replica=self.name,
            host=self.peer_host,
            port=free_port(self.peer_host),
            backend=self.peer_backend,
            base_identity=base,
            identity=inp.identity,
            chain=inp.chain,
            specs=[
                [n, str(self.host.tensor(n).dtype).removeprefix("torch."), list(self.host.info(n).shape)]
                for n in names_
            ],
            expected_adler32={n: checksums[n] for n in names_},
            world_size=inp.world_size,
        )

    # ------------------------------------------------------------------ broadcast walk
    async def send_to_peers(self, offer: PeerOffer) -> int:
        """Broadcast the offered tensors (or delta files) from this engine to every receiver of
        the offer's group (they join concurrently); the engine keeps serving while it sends."""
        held = self.offered_links.pop(offer.port, None)
        try:
            if offer.mode == "files":
                link_dir = held or self.link_dirs[offer.identity]
                await self.engine.start_peer_send_files(_join(offer), [str(link_dir / s[0]) for s in offer.specs])
            else:
                await self.engine.start_peer_stage_send(_join(offer), [s[0] for s in offer.specs])
            return int((await self.engine.wait_job("send"))["bytes"])
        finally:
            self.peer_stores.pop(offer.port, None)  # the group is formed (or failed): its store is done
            if held is not None:
                await asyncio.to_thread(shutil.rmtree, held, True)

    async def drop_peer_stage(self) -> None:
        """Undo a stage that was never committed (a canceled walk): the host copy goes back to
        what the engine serves, and the engine drops its staged tensors. Waits for the host
        copy to have adopted the last swap first (`settled`), so a step that starts here may
        use the host copy and the stage arena."""
        await self.settled()
        stage, self.peer_stage, self.stage_passed_on = self.peer_stage, None, None
        if stage is None:
            return
        if stage.staged is not None and stage.staged.path is not None:
            stage.staged.path.unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            await self.engine.discard_staged()

    async def stage_from_peer(self, offer: PeerOffer, rank: int) -> StageFromPeerResult:
        """Join the offer's group as `rank`, receive and check the tensors into an engine stage
        and a host-side copy; the engine keeps serving its current weights. The fault point
        "stage_from_peer" fires once the bytes arrived, before they are kept (the group's other
        members are not held up); its failure drops what was received."""
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
                _join(offer, rank), offer.identity, offer.specs, expected_adler32=offer.expected_adler32, save_path=path
            )
            got = await self.engine.wait_job("stage")
            # The host copy takes the same bytes the engine checked (no bucket reads).
            received = await asyncio.to_thread(read_raw, path)
        except Exception as exc:
            raise EngineUpdateError(
                f"receiving from {offer.source_replica} failed; previous weights kept: {one_line(exc)}"
            ) from None
        finally:
            path.unlink(missing_ok=True)
        try:
            await self.fault("stage_from_peer")
            wrong = await asyncio.to_thread(adler_mismatches, received, offer.expected_adler32)
            if wrong:
                raise EngineUpdateError(f"received bytes differ from the sender's checksums for {', '.join(wrong[:5])}")
        except BaseException:
            with contextlib.suppress(Exception):
                await self.engine.discard_staged()
            raise
        self.peer_stage = PeerStage(offer=offer, received=received)
        return StageFromPeerResult(
            identity=offer.identity,
            tensors_staged=int(got["tensors"]),
            bytes_received=int(got["bytes"]),
            stage_ms=ms_since(t0),
        )

    async def _stage_files_from_peer(self, offer: PeerOffer, rank: int, t0: float) -> StageFromPeerResult:
        """Receive a delta link's files from a peer, then stage them exactly like the bucket
        path does (host copy first, every changed tensor's Adler-32 checked, then the engine)."""
        chain_ids = [link.identity for link in offer.chain]
        if self.applied != chain_ids[:-1]:
            raise ChainError(
                f"replica {self.name} serves {self.current_identity!r}; the delta from "
                f"{offer.source_replica} applies to {chain_ids[-2]!r}"
            )
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
                _join(offer, rank), offer.specs, offer.expected_adler32, link_dir
            )
            got = await self.engine.wait_job("receive")
        except Exception as exc:
            raise EngineUpdateError(
                f"receiving from {offer.source_replica} failed; previous weights kept: {one_line(exc)}"
            ) from None
        log.info(
            "received %s's delta files from %s: %d bytes, joined in %.0f ms, transfer %.0f ms, %.0f ms "
            "since the step began",
            offer.identity,
            offer.source_replica,
            int(got["bytes"]),
            1000 * float(got.get("join_s", 0)),
            1000 * float(got.get("transfer_s", 0)),
            ms_since(t0),
        )
        await self.fault("stage_from_peer")
        inp = ApplySnapshotInput(hot_load_id="", identity=offer.identity, chain=offer.chain, bucket="", path_prefix="")
        staged = await self.stage_update(inp, {offer.identity: link_dir}, turn)
        self.peer_stage = self.stage_passed_on = PeerStage(offer=offer, received=None, staged=staged)
        return StageFromPeerResult(
            identity=offer.identity,
            tensors_staged=len(staged.names),
            bytes_received=int(got["bytes"]),
            stage_ms=ms_since(t0),
        )

    async def commit_peer_stage(self, identity: str, policy: PromptCachePolicy) -> ApplySnapshotResult:
        """Swap a peer stage in (one short pause), then move the host copy and prove it."""
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
            raise ChainError(
                f"replica {self.name} serves {self.current_identity!r}; the stage completes {offer.base_identity!r}"
            )
        try:
            await self.fault("commit_peer_stage")
        except BaseException:
            self.peer_stage = stage
            await self.drop_peer_stage()
            raise
        t0 = time.perf_counter()
        if stage.staged is not None:  # a delta link received as files, staged like the bucket path
            staged = stage.staged
            pause_ms, prove_ms, verified, breakdown, moved = await self._swap_in(
                staged, [link.identity for link in offer.chain], policy
            )
            log.info(
                "applied %s from %s (delta files): %s",
                identity,
                offer.source_replica,
                fmt({"pause": pause_ms, "prove": prove_ms, "total": ms_since(t0)}),
            )
            return ApplySnapshotResult(
                identity=identity,
                engine_pid=self.engine.pid,
                tensors_loaded=len(staged.names),
                bytes_read_from_bucket=0,
                pause_ms=pause_ms,
                source=f"peer:{offer.source_replica}",
                verified_tensors=verified,
                links_applied=staged.links,
                pause_breakdown_ms=breakdown,
                swap_bytes=moved,
            )
        names_ = [s[0] for s in offer.specs]
        saved = self.host.save(names_)
        self.host.restore(stage.received, checksums=offer.expected_adler32)  # verified at staging
        pause_ms, swap = await self._swap_staged(identity, saved, names_, policy)
        chain_ids = self._commit_offer(offer, names_)
        verified = int(swap["verified"])
        log.info(
            "applied %s from %s: %s", identity, offer.source_replica, fmt({"pause": pause_ms, "total": ms_since(t0)})
        )
        return ApplySnapshotResult(
            identity=identity,
            engine_pid=self.engine.pid,
            tensors_loaded=len(names_),
            bytes_read_from_bucket=0,
            pause_ms=pause_ms,
            source=f"peer:{offer.source_replica}",
            verified_tensors=verified,
            links_applied=chain_ids,
            pause_breakdown_ms=swap["breakdown_ms"],
            swap_bytes=swap_bytes(swap),
        )

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
