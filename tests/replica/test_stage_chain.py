"""`ReplicaRuntime.stage_chain`, unit (no engine): a replica that needs the chain's full base loads
it from the bucket as a new host copy, applies the chain's delta link to that copy, and stages
every tensor with its Adler-32; its current host copy is not touched. A replica that serves the
chain already has nothing to do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from contracts.activities import ApplySnapshotInput
from contracts.records import SnapshotRef, SnapshotType
from replica.agent.runtime import ReplicaRuntime
from snapshots.host import HostWeights, checkpoint_checksums
from snapshots.synthetic import make_checkpoint_pair
from snapshots.writer import write_delta
from tests.helpers.snapshot_helpers import FakeS3

CHAIN = [
    SnapshotRef(identity="v-base", type=SnapshotType.FULL),
    SnapshotRef(identity="v-next", type=SnapshotType.INCREMENTAL),
]
INP = ApplySnapshotInput(hot_load_id="hl", identity="v-next", chain=CHAIN, bucket="b", path_prefix="ckpt")


def test_a_new_base_and_its_delta_are_staged_on_a_new_host_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUTS_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    make_checkpoint_pair(tmp_path / "base", tmp_path / "new", size_mb=2, lr=1e-2)
    write_delta(tmp_path / "base", tmp_path / "new", tmp_path / "delta", version="v-next", base_version="v-base")
    shutil.copytree(tmp_path / "base", tmp_path / "s3" / "b" / "ckpt" / "v-base")
    current = HostWeights.load(tmp_path / "base")
    before = current.checksums()
    rt = ReplicaRuntime(name="r", engine=None, host=current, s3=FakeS3(tmp_path / "s3"), workdir=tmp_path / "r")
    rt.applied = ["initial"]

    staged = rt.stage_chain(INP, {"v-next": tmp_path / "delta"})

    want = checkpoint_checksums(tmp_path / "new")
    assert staged.new_host is not None and staged.new_host.checksums() == want
    assert staged.expected == want and staged.names == sorted(want)
    assert staged.links == ["v-base", "v-next"] and staged.changed_by_link["v-base"] is None
    assert staged.changed_by_link["v-next"] and staged.path is not None and staged.path.exists()
    assert current.checksums() == before != want  # the serving host copy is untouched
    rt.applied = ["v-base", "v-next"]
    assert rt.stage_chain(INP).nothing_to_do
