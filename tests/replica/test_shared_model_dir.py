"""The model directory a dynamo deployment's replicas on one host share
(``replica.agent.downloads``), unit: downloaded once, kept while any replica of the host still
uses it, removed by the last one to leave, and downloaded again by a replica that arrives after.
The bucket is a stand-in (two objects); the real one serves every e2e test's replicas."""

from __future__ import annotations

from pathlib import Path

from replica.agent.downloads import download_shared, shared_use

OBJECTS = {"models/shared/config.json": b"{}", "models/shared/model.safetensors": b"w" * 1000}


class Bucket:
    """A stand-in for boto3's S3 client: what ``download_prefix`` calls, counting downloads."""

    def __init__(self) -> None:
        self.downloads = 0

    def get_paginator(self, _name: str):
        return self

    def paginate(self, Bucket: str, Prefix: str, Delimiter: str):  # noqa: N803 - boto3's names
        return [{"Contents": [{"Key": k, "Size": len(v)} for k, v in OBJECTS.items() if k.startswith(Prefix)]}]

    def download_file(self, bucket: str, key: str, path: str) -> None:
        self.downloads += 1
        Path(path).write_bytes(OBJECTS[key])


def test_the_last_replica_to_leave_removes_the_shared_copy(tmp_path: Path) -> None:
    s3 = Bucket()
    dest = tmp_path / "rollouts-models" / "digest"
    with shared_use(dest):
        assert download_shared(s3, "b", "models/shared", dest) == dest
        with shared_use(dest):  # a second replica of the deployment on this host
            download_shared(s3, "b", "models/shared", dest)
            assert s3.downloads == 2  # the two objects, once
        assert (dest / "model.safetensors").read_bytes() == OBJECTS["models/shared/model.safetensors"]
    assert not dest.exists()  # the last one removed it
    with shared_use(dest):  # a replica that arrives later downloads it again
        download_shared(s3, "b", "models/shared", dest)
        assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    assert not dest.exists() and s3.downloads == 4
