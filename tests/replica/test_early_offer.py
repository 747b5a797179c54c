"""The early offer (`PeerOfferInput.from_stage`): a replica updating from the bucket offers the
delta link's files once its own decode checked them, before its swap; it refuses when the update
ends without such files. The runtime's offer logic only (no engine: it is not touched here); the
e2e delta tests run it on real replicas."""

from __future__ import annotations

import asyncio
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from contracts.activities import PeerOfferInput
from contracts.records import SnapshotRef, SnapshotType
from replica.agent.peers import OFFERS_KEPT, PEER_BACKEND_ENV, peer_backend
from replica.agent.runtime import ReplicaRuntime
from replica.agent.staged import StagedUpdate
from replica.peer_join import PeerJoin
from snapshots.errors import ChainError

CHAIN = [
    SnapshotRef(identity="base", type=SnapshotType.FULL),
    SnapshotRef(identity="step-1", type=SnapshotType.INCREMENTAL),
]


def _runtime(tmp_path: Path, backend: str = "gloo") -> ReplicaRuntime:
    return ReplicaRuntime(name="replica-a", engine=None, host=None, s3=None, workdir=tmp_path, peer_backend=backend)


def _ask(target: str = "base") -> PeerOfferInput:
    return PeerOfferInput(
        hot_load_id="hl-1",
        identity="step-1",
        chain=CHAIN,
        target_identity=target,
        world_size=3,
        accept_files=True,
        from_stage=True,
    )


def _staged_files(tmp_path: Path) -> StagedUpdate:
    link = tmp_path / "links" / "step-1"
    link.mkdir(parents=True)
    (link / "model.safetensors").write_bytes(b"delta bytes")
    (link / "manifest.json").write_bytes(b"{}")
    return StagedUpdate(identity="step-1", names=["w"], link_dirs={"step-1": link}, arena_offsets={"w": 0})


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
async def test_the_offer_waits_for_the_stage_then_offers_its_files(tmp_path: Path, backend: str) -> None:
    rt = _runtime(tmp_path, backend)
    asking = asyncio.ensure_future(rt.make_offer_from_stage(_ask()))
    await asyncio.sleep(0.1)
    assert not asking.done()  # nothing staged yet
    rt.update_stage("hl-1", fresh=True).set_result(_staged_files(tmp_path))
    offer = await asyncio.wait_for(asking, 5)
    assert offer.mode == "files" and offer.base_identity == "base" and offer.world_size == 3
    assert offer.backend == backend  # a delta's files travel over either backend
    assert sorted(s[0] for s in offer.specs) == ["manifest.json", "model.safetensors"]
    assert offer.expected_adler32["model.safetensors"] == f"{zlib.adler32(b'delta bytes'):08x}"
    held = rt.offered_links[offer.port]
    assert held == rt.offers_root / str(offer.port)
    assert (held / "model.safetensors").read_bytes() == b"delta bytes"


class _SendingEngine:
    """Reads the files a send names, as the engine's send job would (unit test stand-in)."""

    def __init__(self) -> None:
        self.sent: dict[str, bytes] = {}

    async def start_peer_send_files(self, join: PeerJoin, paths: list[str]) -> None:
        self.sent = {Path(p).name: Path(p).read_bytes() for p in paths}

    async def wait_job(self, kind: str) -> dict[str, int]:
        return {"bytes": sum(len(b) for b in self.sent.values())}


async def test_an_offers_files_outlive_the_next_updates_clear_until_its_send(tmp_path: Path) -> None:
    """A replica that serves the update offers its link's files, then an update (the walk's
    re-admission of the same identity, or the next one) clears its links: the send still has
    every offered file, and drops its own hold after."""
    engine = _SendingEngine()
    rt = ReplicaRuntime(name="replica-a", engine=engine, host=None, s3=None, workdir=tmp_path)
    rt.staging = tmp_path
    rt.update_stage("hl-1", fresh=True).set_result(_staged_files(tmp_path))
    offer = await rt.make_offer_from_stage(_ask())
    rt.clear_links()
    assert not (tmp_path / "links").exists()
    assert await rt.send_to_peers(offer) == len(b"delta bytes") + len(b"{}")
    assert engine.sent == {"manifest.json": b"{}", "model.safetensors": b"delta bytes"}
    assert not rt.offers_root.joinpath(str(offer.port)).exists() and not rt.offered_links


async def test_a_send_closes_its_own_offers_store_not_another_offers(tmp_path: Path) -> None:
    """A sender holding two offers (two groups) hosts one rendezvous store per offer: the first
    one's send ends its store, and the second group's members still meet at theirs."""
    rt = ReplicaRuntime(
        name="replica-a", engine=_SendingEngine(), host=None, s3=None, workdir=tmp_path, peer_host="127.0.0.1"
    )
    rt.staging = tmp_path
    rt.update_stage("hl-1", fresh=True).set_result(_staged_files(tmp_path))
    hosting = _ask().model_copy(update={"host_store": True})
    first, second = [await rt.make_offer_from_stage(hosting) for _ in range(2)]
    assert first.store_hosted and second.store_hosted and first.port != second.port
    await rt.send_to_peers(first)
    assert list(rt.peer_stores) == [second.port]
    client = TCPStore("127.0.0.1", second.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("member", "1")
    assert rt.peer_stores[second.port].get("member") == b"1"


async def test_offers_never_sent_are_dropped_after_the_newest_few(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    rt.staging = tmp_path
    rt.update_stage("hl-1", fresh=True).set_result(_staged_files(tmp_path))
    ports = [(await rt.make_offer_from_stage(_ask())).port for _ in range(OFFERS_KEPT + 3)]
    assert list(rt.offered_links) == ports[-OFFERS_KEPT:]
    assert sorted(p.name for p in rt.offers_root.iterdir()) == sorted(str(p) for p in ports[-OFFERS_KEPT:])


async def test_an_update_that_ended_without_a_stage_refuses_the_offer(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    asking = asyncio.ensure_future(rt.make_offer_from_stage(_ask()))
    await asyncio.sleep(0.05)
    rt.update_stage("hl-1", fresh=True).set_exception(ChainError("replica-a's update to step-1 ended before it staged"))
    with pytest.raises(ChainError, match="ended before it staged"):
        await asyncio.wait_for(asking, 5)


@pytest.mark.parametrize("case", ["no files", "other base"])
async def test_a_stage_without_files_for_the_receivers_is_refused(tmp_path: Path, case: str) -> None:
    rt = _runtime(tmp_path)
    staged = _staged_files(tmp_path)
    if case == "no files":
        staged.arena_offsets = {}  # a new full base: staged from a file, no delta to pass on
    rt.update_stage("hl-1", fresh=True).set_result(staged)
    with pytest.raises(ChainError, match="holds no delta files"):
        await rt.make_offer_from_stage(_ask(target="older" if case == "other base" else "base"))


async def test_no_stage_in_time_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ChainError, match="staged nothing"):
        await _runtime(tmp_path).make_offer_from_stage(_ask(), wait_s=0.1)


async def test_a_new_update_replaces_a_finished_one_but_not_one_an_offer_waits_on(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    waited_on = rt.update_stage("hl-1")  # an offer arrived first
    assert rt.update_stage("hl-1", fresh=True) is waited_on
    waited_on.set_result(_staged_files(tmp_path))
    retry = rt.update_stage("hl-1", fresh=True)  # a retried step stages again
    assert retry is not waited_on and not retry.done()
    for i in range(6):
        rt.update_stage(f"other-{i}", fresh=True)
    assert len(rt.update_stages) <= 4 and retry.cancelled()


def test_the_peer_backend_is_gloo_unless_a_gpu_replica_opts_into_nccl() -> None:
    assert peer_backend({}) == "gloo" and peer_backend({PEER_BACKEND_ENV: ""}) == "gloo"
    assert peer_backend({PEER_BACKEND_ENV: "nccl", "CUDA_VISIBLE_DEVICES": "0,1"}) == "nccl"
    with pytest.raises(ValueError, match="ROLLOUTS_PEER_BACKEND=nccl needs a replica placed on GPUs"):
        peer_backend({PEER_BACKEND_ENV: "nccl"})
    with pytest.raises(ValueError, match="ROLLOUTS_PEER_BACKEND='mpi': not one of gloo, nccl"):
        peer_backend({PEER_BACKEND_ENV: "mpi"})
