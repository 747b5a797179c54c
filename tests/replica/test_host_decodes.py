"""One decode per host: a replica copies a sibling's checked decode of the same update, and
decodes itself whenever that copy cannot be trusted (replica.agent.host_decodes).

Two replica runtimes in this process stand in for two agents of one host: each has its own host
copy and its own stage arena (a file another process opens through /proc/PID/fd/FD, as here),
and the arenas' directory is the test's own, so no other test's records are seen.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from contracts.activities import ApplySnapshotInput
from contracts.records import SnapshotRef, SnapshotType
from replica.agent import host_decodes
from replica.agent import runtime as runtime_module
from replica.agent.runtime import ReplicaRuntime
from snapshots.errors import SnapshotError
from snapshots.host import HostWeights, checkpoint_checksums
from snapshots.synthetic import make_checkpoint_pair
from snapshots.writer import write_delta

CHAIN = [
    SnapshotRef(identity="v-base", type=SnapshotType.FULL),
    SnapshotRef(identity="v-next", type=SnapshotType.INCREMENTAL),
]
INP = ApplySnapshotInput(hot_load_id="hl", identity="v-next", chain=CHAIN, bucket="", path_prefix="")


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.setenv("ROLLOUTS_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    make_checkpoint_pair(tmp_path / "base", tmp_path / "new", size_mb=2, lr=1e-2)
    write_delta(tmp_path / "base", tmp_path / "new", tmp_path / "delta", version="v-next", base_version="v-base")
    return {"root": tmp_path, "base": tmp_path / "base", "new": tmp_path / "new", "delta": tmp_path / "delta"}


def runtime(paths: dict[str, Path], name: str) -> ReplicaRuntime:
    rt = ReplicaRuntime(
        name=name, engine=None, host=HostWeights.load(paths["base"]), s3=None, workdir=paths["root"] / name
    )
    rt.applied = ["v-base"]
    return rt


def decoded_sums(staged) -> dict[str, str]:
    return {n: host_decodes._copy_checked(a, np.empty_like(a)) for n, a in staged.decoded.items()}


def forbid_decode(rt: ReplicaRuntime) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("decoded again although a sibling's decode was published")

    rt.host.decode_delta_into = refuse


def stages(replica: str, how: str) -> float:
    """`rollouts_replica_delta_stages_total` of `replica` (replica/agent/metrics.py)."""
    labels = {"deployment": "", "replica": replica, "how": how}
    return REGISTRY.get_sample_value("rollouts_replica_delta_stages_total", labels) or 0.0


def refuse_plan(*_a, **_k):
    raise AssertionError("read a delta plan although a sibling's decode was published")


def test_the_second_replica_copies_the_first_ones_decode(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = runtime(setup, "r1"), runtime(setup, "r2")
    before = {(r, how): stages(r, how) for r in ("r1", "r2") for how in ("decoded", "copied")}
    staged1 = first.decode_links(INP, CHAIN[1:], {"v-next": setup["delta"]})
    assert staged1.copied_from == "" and staged1.names
    forbid_decode(second)
    # It finds the decode by the files' headers: no delta plan is read (that is the first one's work).
    monkeypatch.setattr(runtime_module, "read_delta_plan", refuse_plan)
    staged2 = second.decode_links(INP, CHAIN[1:], {"v-next": setup["delta"]})
    assert staged2.copied_from == first.arena.path
    # The metric says which stage was decoded and which copied.
    assert {k: stages(*k) - v for k, v in before.items()} == {
        ("r1", "decoded"): 1,
        ("r1", "copied"): 0,
        ("r2", "decoded"): 0,
        ("r2", "copied"): 1,
    }
    assert staged2.names == staged1.names and staged2.expected == staged1.expected
    assert staged2.changed_by_link == staged1.changed_by_link and staged2.links == ["v-next"]
    new = checkpoint_checksums(setup["new"])
    assert decoded_sums(staged2) == {n: new[n] for n in staged2.names}
    # Its own arena, not a view of the first one's.
    assert set(staged2.arena_offsets) == set(staged2.names)
    assert all(second.arena.offset_of(a) >= 0 for a in staged2.decoded.values())


def test_a_withdrawn_or_other_update_is_decoded_again(setup) -> None:
    first, second = runtime(setup, "r1"), runtime(setup, "r2")
    first.decode_links(INP, CHAIN[1:], {"v-next": setup["delta"]})
    first.withdraw_decode()  # as its agent does before the arena is written again, and as it stops
    assert first.decode_published is None and not host_decodes.read_records(first.arena.directory)
    assert second.decode_links(INP, CHAIN[1:], {"v-next": setup["delta"]}).copied_from == ""
    # Other weights underneath (another applied chain): another key, so a decode of its own.
    third = runtime(setup, "r3")
    third.applied = ["v-other"]
    assert third.decode_links(INP, CHAIN[1:], {"v-next": setup["delta"]}).copied_from == ""


def test_other_files_under_the_same_link_are_decoded_again(setup) -> None:
    """The key binds each shard's header (every frame's place and tensor's Adler-32), not only
    the link's name: files of another step published under the same identity are decoded."""
    first, second = runtime(setup, "r1"), runtime(setup, "r2")
    first.decode_links(INP, CHAIN[1:], {"v-next": setup["delta"]})
    root = setup["root"]
    make_checkpoint_pair(root / "base2", root / "other", size_mb=2, lr=3e-2)
    write_delta(setup["base"], root / "other", root / "other-delta", version="v-next", base_version="v-base")
    staged = second.decode_links(INP, CHAIN[1:], {"v-next": root / "other-delta"})
    assert staged.copied_from == ""
    other = checkpoint_checksums(root / "other")
    assert decoded_sums(staged) == {n: other[n] for n in staged.names}


def test_nothing_unchecked_is_copied(setup) -> None:
    first = runtime(setup, "r1")
    staged = first.decode_links(INP, CHAIN[1:], {"v-next": setup["delta"]})
    directory = first.arena.directory
    key = next(directory.glob("rollouts-decoded-*.json")).name.removeprefix("rollouts-decoded-").removesuffix(".json")
    published = host_decodes.read_published(directory, key)
    assert published is not None and published.checksums == staged.expected
    dest = np.zeros(published.size + 4096, dtype=np.uint8)
    out = dict(published.places)  # the same layout (runs copied at once)
    assert host_decodes.copy_published(published, dest, out) == first.arena.path
    assert all(bytes(dest[o : o + n]) == bytes(staged.decoded[name]) for name, (o, n) in out.items())
    shifted = {name: (o + 64, n) for name, (o, n) in out.items()}  # runs, 64 bytes further on
    assert host_decodes.copy_published(published, dest, shifted) == first.arena.path
    assert all(bytes(dest[o : o + n]) == bytes(staged.decoded[name]) for name, (o, n) in shifted.items())
    # Another layout (shifted, the last tensor first): copied one at a time, each in its own place.
    last = max(out, key=lambda name: out[name][0])
    other = {name: (o + 4096 - out[last][1], n) for name, (o, n) in out.items() if name != last}
    other[last] = (0, out[last][1])
    dest[:] = 0
    assert host_decodes.copy_published(published, dest, other) == first.arena.path
    assert all(bytes(dest[o : o + n]) == bytes(staged.decoded[name]) for name, (o, n) in other.items())

    # A byte of the published arena changes: its Adler-32 differs from the record's.
    victim = staged.names[0]
    staged.decoded[victim][0] ^= 1
    assert host_decodes.copy_published(published, dest, out) is None
    staged.decoded[victim][0] ^= 1

    # The record is replaced while the copy runs (its arena reused and published again).
    copy = host_decodes._copy_checked
    calls = []
    once = threading.Lock()  # the copy runs on several threads

    def republish(src, dst):
        with once:
            if not calls:
                calls.append(
                    host_decodes.publish(
                        directory,
                        key,
                        first.arena.path,
                        first.arena.size,
                        {
                            n: (first.arena.offset_of(a), a.nbytes, staged.expected[n])
                            for n, a in staged.decoded.items()
                        },
                        {"v-next": list(staged.names)},
                    )
                )
        return copy(src, dst)

    host_decodes._copy_checked = republish
    try:
        assert host_decodes.copy_published(published, dest, out, workers=1) is None
    finally:
        host_decodes._copy_checked = copy
    published = host_decodes.read_published(directory, key)
    assert published is not None and host_decodes.copy_published(published, dest, out) == first.arena.path

    # Other tensors or sizes than the record names.
    assert host_decodes.copy_published(published, dest, {victim: out[victim]}) is None
    assert host_decodes.copy_published(published, dest, {**out, victim: (out[victim][0], out[victim][1] - 1)}) is None

    # A record that names a tensor outside its arena, or changes it does not hold, is not read.
    record = host_decodes.record_path(directory, key)
    text = record.read_text()
    broken = json.loads(text)
    broken["size"] = 8
    record.write_text(json.dumps(broken))
    assert host_decodes.read_published(directory, key) is None
    for change in ("not-decoded", -1, len(staged.names)):
        broken = json.loads(text)
        broken["changed"]["v-next"].append(change)
        record.write_text(json.dumps(broken))
        assert host_decodes.read_published(directory, key) is None, change
    broken = json.loads(text)
    broken["offsets"][0] = -64
    record.write_text(json.dumps(broken))
    assert host_decodes.read_published(directory, key) is None
    record.write_text(text)

    # The publishing agent is gone: its descriptor no longer opens, and the next publish on
    # the host removes its record.
    record.write_text(text.replace(first.arena.path, "/proc/999999999/fd/3"))
    published = host_decodes.read_published(directory, key)
    assert published is not None and host_decodes.copy_published(published, dest, out) is None
    host_decodes.publish(directory, "other", first.arena.path, first.arena.size, {}, {})
    assert not record.exists()


def test_a_corrupt_delta_is_refused_and_nothing_is_published(setup) -> None:
    second = runtime(setup, "r2")
    bad = setup["root"] / "bad"
    bad.mkdir()
    for f in setup["delta"].iterdir():
        data = bytearray(f.read_bytes())
        if f.name.endswith(".safetensors"):
            data[-10] ^= 0xFF  # inside the last tensor's frame
        (bad / f.name).write_bytes(bytes(data))
    with pytest.raises(SnapshotError):
        second.decode_links(INP, CHAIN[1:], {"v-next": bad})
    assert second.decode_published is None
    assert not list(second.arena.directory.glob("rollouts-decoded-*"))


def test_records_of_agents_that_are_gone_are_removed_and_no_others(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = host_decodes.publish(tmp_path, "live", f"/proc/{os.getpid()}/fd/3", 8, {"t": (0, 8, "0")}, {})
    dead = host_decodes.publish(tmp_path, "dead", f"/proc/{gone.pid}/fd/3", 8, {"t": (0, 8, "0")}, {})  # last
    other = tmp_path / "rollouts-decoded-unreadable.json"
    other.write_text("not json")
    assert host_decodes.remove_stale(tmp_path) == [dead.path]
    assert not dead.path.exists() and live.path.exists() and other.exists()
