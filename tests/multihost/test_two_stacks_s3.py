"""Two stacks on one machine, the same port numbers, each with its own S3: one on 127.0.0.1 in
the root namespace, one on a network-namespace host (which shares this machine's ``/tmp``).

SeaweedFS fixes its gRPC Unix sockets' paths from the gRPC port alone
(``/tmp/seaweedfs-<service>-grpc-<port>.sock``); the stack chooses those ports machine-wide
(workers/seaweed_grpc.py). Each S3 writes, lists and reads only its own objects; stopping one
leaves the other's sockets in place, and it still lists, reads and writes its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.processes import stop_pid
from common.settings import Settings
from tests.helpers.stack_fixtures import free_port_base
from workers import seaweed_grpc
from workers.stack import Stack

pytestmark = pytest.mark.stack  # it starts SeaweedFS itself (no session stack)

REPO = Path(__file__).resolve().parents[2]
START_S3 = (
    "import sys; from pathlib import Path; from common.settings import Settings; "
    "from workers.stack import Stack; print(Stack(Settings.own(Path(sys.argv[1])), node_slots=0).start('s3'))"
)


def keys(settings: Settings) -> list[str]:
    listed = settings.s3_client().list_objects_v2(Bucket=settings.bucket)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def read(settings: Settings, key: str) -> bytes:
    return settings.s3_client().get_object(Bucket=settings.bucket, Key=key)["Body"].read()


def test_two_stacks_with_the_same_ports_keep_their_own_s3(make_cluster, tmp_path):
    base = free_port_base()
    here = Settings.create(tmp_path / "here", base)
    here.save()
    here_stack = Stack(here, node_slots=0)
    with make_cluster(1) as cluster:
        host = cluster[0]
        there = Settings.create(host.home / "stack", base, host=host.address)
        there.bucket = here.bucket  # the same bucket name too: only the store tells them apart
        there.save()
        try:
            print(here_stack.start("s3"))
            started = host.run([sys.executable, "-c", START_S3, str(there.home_path)], cwd=REPO, timeout=120)
            assert started.returncode == 0, started.stderr[-3000:]
            ours, theirs = here_stack.weed_grpc_ports(), Stack(there, node_slots=0).weed_grpc_ports()
            assert set(ours.values()).isdisjoint(theirs.values()), (ours, theirs)
            assert here.ports["s3"] == there.ports["s3"]

            here.s3_client().put_object(Bucket=here.bucket, Key="here/only", Body=b"here" * 4096)
            there.s3_client().put_object(Bucket=there.bucket, Key="there/only", Body=b"there" * 4096)
            assert keys(here) == ["here/only"] and keys(there) == ["there/only"]
            assert read(here, "here/only") == b"here" * 4096 and read(there, "there/only") == b"there" * 4096

            stop_pid(Stack(there, node_slots=0).pid_file("s3").alive_pid(), timeout=20)
            assert seaweed_grpc.all_live(ours), "stopping the other stack removed this stack's gRPC sockets"
            assert keys(here) == ["here/only"]
            assert read(here, "here/only") == b"here" * 4096
            here.s3_client().put_object(Bucket=here.bucket, Key="here/after", Body=b"after" * 4096)
            assert keys(here) == ["here/after", "here/only"] and read(here, "here/after") == b"after" * 4096
        finally:
            here_stack.down(say=lambda line: None)
    assert not subprocess.run(["pgrep", "-f", str(here.home_path)], capture_output=True).stdout
