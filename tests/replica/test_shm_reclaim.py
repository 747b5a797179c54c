"""Shared memory of dead engines is reclaimed, and only that (replica/agent/shm_reclaim.py).

Covers: a ``psm_`` segment left by a killed process group (as a killed vLLM engine leaves its
message queues: Python's resource tracker dies with it) is removed from ``/dev/shm``; segments a
live process maps or holds open stay, as do other names and files others may read; the session's
real vLLM one-rank engine maps no queue segment at all, and an engine with worker processes (a
tensor-parallel one's executor) keeps every segment it maps and still serves after a reclaim.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from replica.agent.engine_process import INPROC_WORKER_ENV, EngineProcess
from replica.agent.shm_reclaim import DEV_SHM, reclaim_dead_segments
from tests.helpers.engine_cache import model_infos

HOLDER = """
import mmap, os, sys, time
from multiprocessing import shared_memory
mapped, held = sys.argv[1], sys.argv[2]
fd = os.open(mapped, os.O_RDWR)
view = mmap.mmap(fd, 0)
os.close(fd)  # only the mapping keeps it
keep = os.open(held, os.O_RDONLY)  # only the descriptor keeps it
leaked = shared_memory.SharedMemory(create=True, size=1 << 20)
leaked.buf[:4] = b"leak"
print(leaked.name, flush=True)
time.sleep(600)
"""


@pytest.fixture
def private_shm() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rollouts-test-reclaim-", dir=DEV_SHM))
    try:
        yield path
    finally:
        for f in path.iterdir():
            f.unlink()
        path.rmdir()


def segment(directory: Path, name: str, mode: int = 0o600) -> Path:
    path = directory / name
    path.write_bytes(b"\0" * 65536)
    path.chmod(mode)
    return path


def test_reclaims_a_killed_process_segments_and_keeps_live_ones(private_shm: Path) -> None:
    orphan = segment(private_shm, "psm_orphan")
    mapped = segment(private_shm, "psm_mapped")
    held = segment(private_shm, "psm_held")
    stage = segment(private_shm, "rollouts-stage-orphan")
    foreign = segment(private_shm, "someone-elses")  # a name no engine or replica creates
    shared = segment(private_shm, "psm_shared", 0o644)  # others may have it open
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(mapped), str(held)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        leaked = DEV_SHM / holder.stdout.readline().strip()
        assert leaked.name.startswith("psm_") and leaked.exists()

        removed = reclaim_dead_segments([private_shm])
        assert {s.path for s in removed} == {orphan, stage}
        assert all(s.bytes >= 65536 for s in removed)
        assert not orphan.exists() and not stage.exists()
        assert mapped.exists() and held.exists() and foreign.exists() and shared.exists()

        # The live process's own segment in /dev/shm is mapped: a reclaim there keeps it.
        reclaim_dead_segments()
        assert leaked.exists()
    finally:
        # The whole group, Python's resource tracker included: nobody cleans up after it.
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    assert leaked.exists(), "the killed group's segment should outlive it (else this test proves nothing)"
    removed = reclaim_dead_segments()
    assert leaked in {s.path for s in removed}
    assert not leaked.exists()
    assert {s.path for s in reclaim_dead_segments([private_shm])} == {mapped, held}
    assert foreign.exists() and shared.exists()


def engine_segments(pids: list[int]) -> set[Path]:
    """The /dev/shm files these processes map."""
    found: set[Path] = set()
    for pid in pids:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(f"{DEV_SHM}/") and not parts[5].endswith("(deleted)"):
                found.add(Path(parts[5]))
    return found


async def test_a_one_rank_engine_maps_no_queue_segments(engine: EngineProcess) -> None:
    """A one-rank CPU engine runs its worker inside the engine core (replica/agent/engine_process.py):
    no message queue between them, so nothing of it in /dev/shm to leak when it is killed."""
    pids = await engine.engine_pids()
    assert pids["worker_parent"] == pids["server"]  # the worker is the engine core itself
    assert not any(p.name.startswith("psm_") for p in engine_segments(list(set(pids.values()))))


@pytest.mark.engine
async def test_a_running_engine_keeps_its_segments(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The engine of a tensor-parallel replica has a worker process per rank and vLLM's message
    queues between them in /dev/shm (``psm_``). Its own engine (why this test starts one): one
    rank with a worker process of its own, the executor tensor-parallel engines run, so that its
    queues exist; a reclaim keeps every segment it maps, and it still serves."""
    # A short work directory: vLLM's IPC socket paths under it must fit a socket address.
    engine = EngineProcess(
        model_dirs["base"],
        work_dir=tmp_path_factory.mktemp("e"),
        served_model_name="base",
        env={INPROC_WORKER_ENV: "1"},
        model_info_cache=model_infos(),
    )
    await engine.start(timeout=600)
    try:
        pids = await engine.engine_pids()
        mapped = engine_segments(
            [pids["worker"], pids["worker_parent"]] + ([pids["server"]] if "server" in pids else [])
        )
        assert any(p.name.startswith("psm_") for p in mapped), mapped  # vLLM's message queues
        removed = {s.path for s in reclaim_dead_segments()}
        assert not removed & mapped
        assert all(p.exists() for p in mapped)
        assert await engine.health()
        assert await engine.models() == ["base"]
    finally:
        await engine.stop()
