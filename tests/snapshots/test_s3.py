"""The snapshots package against a real S3 server (SeaweedFS, started by the ``seaweed``
fixture): inspect, chain resolution and apply from ``s3://bucket/prefix/identity/``, and proof,
by counting the client's GETs and their bytes, that a delta costs ranged GETs of just its changed
tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.settings import Settings
from snapshots import (
    ChainError,
    ChainLink,
    HostWeights,
    LayoutError,
    check_required_files,
    inspect_snapshot,
    materialize_chain,
    read_delta_plan,
    read_full_layout,
    resolve_chain,
    write_delta,
    write_full_snapshot,
)
from snapshots.cli import main
from snapshots.safetensors_io import HEADER_PROBE_BYTES, TensorSpec
from snapshots.storage import snapshot_uri
from tests.helpers.snapshot_helpers import INDEX, GetCounter, ranges, raw_bytes
from workers.stack import upload_dir

RUN = "snapshot-tests/run-1"
#: The previous identity of each delta, as its hot-load request carries it.
PREVIOUS = {"step-1": "step-0", "step-2": "step-1"}


@pytest.fixture(scope="module")
def s3(seaweed: Settings) -> Any:
    return seaweed.s3_client()


@pytest.fixture(scope="module")
def published(seaweed: Settings, s3: Any, chain: tuple[Path, list[Path], Path]) -> dict[str, str]:
    """step-0 (full), step-1 and step-2 (deltas) under ``s3://BUCKET/snapshot-tests/run-1/``."""
    base, deltas, _ = chain
    uris = {}
    for identity, local in zip(("step-0", "step-1", "step-2"), (base, *deltas)):
        upload_dir(s3, local, seaweed.bucket, f"{RUN}/{identity}")
        uris[identity] = snapshot_uri(seaweed.bucket, RUN, identity)
    return uris


def test_inspect_and_required_files(seaweed: Settings, s3: Any, published: dict[str, str], chain) -> None:
    base, deltas, _ = chain
    remote, local = inspect_snapshot(published["step-0"], s3=s3), inspect_snapshot(base)
    assert remote.location == published["step-0"] and remote.type == "full"
    for field in ("files", "total_bytes", "tensors", "tensor_bytes", "metadata", "checksummed_tensors"):
        assert getattr(remote, field) == getattr(local, field), field
    # A nested object is not part of the snapshot.
    s3.put_object(Bucket=seaweed.bucket, Key=f"{RUN}/step-1/nested/x.safetensors", Body=b"junk")
    info = inspect_snapshot(published["step-1"], s3=s3, previous_identity="step-0")
    assert info.type == "delta" and info.previous_identity == "step-0"
    assert info.changed_tensors == inspect_snapshot(deltas[0]).changed_tensors
    assert set(info.files) == {p.name for p in deltas[0].iterdir()}
    assert check_required_files(published["step-0"], "full", s3=s3) == []
    assert check_required_files(published["step-1"], "delta", s3=s3) == []
    with pytest.raises(LayoutError, match="this is a full snapshot, not a delta"):
        check_required_files(published["step-0"], "delta", s3=s3)
    nowhere = snapshot_uri(seaweed.bucket, RUN, "step-9")
    assert check_required_files(nowhere, "full", s3=s3) == ["config.json", INDEX]
    with pytest.raises(LayoutError, match=rf"{nowhere}: missing {INDEX}"):
        inspect_snapshot(nowhere, s3=s3)


def _known(s3: Any, bucket: str) -> dict[str, ChainLink]:
    """Every snapshot under RUN, typed by inspecting it, chained by the requests' identities."""
    listing = s3.list_objects_v2(Bucket=bucket, Prefix=f"{RUN}/", Delimiter="/")
    identities = [p["Prefix"][len(RUN) + 1 : -1] for p in listing.get("CommonPrefixes", [])]
    return {
        i: ChainLink(i, inspect_snapshot(snapshot_uri(bucket, RUN, i), s3=s3).type, PREVIOUS.get(i)) for i in identities
    }


def test_chain_resolves_and_materializes_from_s3(
    seaweed: Settings,
    s3: Any,
    published: dict[str, str],
    chain,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    known = _known(s3, seaweed.bucket)
    links = resolve_chain("step-2", known)
    assert [(link.identity, link.type) for link in links] == [
        ("step-0", "full"),
        ("step-1", "delta"),
        ("step-2", "delta"),
    ]
    uris = [snapshot_uri(seaweed.bucket, RUN, link.identity) for link in links]
    out = materialize_chain(uris[0], uris[1:], tmp_path / "out", s3=s3)
    assert raw_bytes(HostWeights.load(out)) == raw_bytes(HostWeights.load(chain[2]))
    assert (out / "config.json").read_bytes() == (chain[0] / "config.json").read_bytes()
    # The CLI does the same from the standard environment.
    for key, value in {
        "AWS_ENDPOINT_URL_S3": seaweed.s3_endpoint,
        "AWS_ACCESS_KEY_ID": seaweed.s3_access_key,
        "AWS_SECRET_ACCESS_KEY": seaweed.s3_secret_key,
        "AWS_REGION": seaweed.s3_region,
    }.items():
        monkeypatch.setenv(key, value)
    assert main(["apply", *uris, "--out", str(tmp_path / "cli")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [d["location"] for d in printed["deltas"]] == uris[1:]
    assert main(["verify", str(tmp_path / "cli"), "--against", str(chain[2])]) == 0
    assert main(["inspect", uris[2], "--previous-identity", "step-1"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["type"] == "delta"


def test_missing_link_is_named(seaweed: Settings, s3: Any, published: dict[str, str], chain, tmp_path: Path) -> None:
    known = _known(s3, seaweed.bucket)
    del known["step-1"]
    with pytest.raises(ChainError, match=r"'step-1' \(the base of 'step-2'\): no such snapshot"):
        resolve_chain("step-2", known)
    # A link whose index never arrived: admission lists it missing, apply names it, writes nothing.
    broken = "snapshot-tests/broken/step-1"
    for path in chain[1][0].iterdir():
        if path.name != INDEX:
            s3.upload_file(str(path), seaweed.bucket, f"{broken}/{path.name}")
    broken_uri = snapshot_uri(seaweed.bucket, "snapshot-tests/broken", "step-1")
    assert check_required_files(broken_uri, "delta", s3=s3) == [INDEX]
    with pytest.raises(LayoutError, match=rf"{broken_uri}: missing {INDEX}"):
        materialize_chain(published["step-0"], [broken_uri, published["step-2"]], tmp_path / "out", s3=s3)
    assert not (tmp_path / "out").exists()


def _probes(files: dict[str, int]) -> list[tuple[str, int, int]]:
    """The header reads a location's shards cost: one ranged GET from byte 0 each."""
    return sorted(
        (name, 0, min(size, HEADER_PROBE_BYTES)) for name, size in files.items() if name.endswith(".safetensors")
    )


def test_a_delta_costs_ranged_gets_of_just_its_changed_tensors(
    seaweed: Settings, pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """A delta changing 2 tensors of the model: applying it from S3, to the host copy or streamed
    to a directory, fetches its index, one header read per shard, and exactly those 2 frames;
    a base on S3 is read with one ranged GET per tensor, each byte once."""
    weights = HostWeights.load(pair[0])
    changed = ["lm_head.weight", "model.layers.0.mlp.up_proj.weight"]
    tensors = {}
    for name in weights.names():
        data = weights.raw(name).copy()
        if name in changed:
            data[::97] ^= 0x01
        tensors[name] = TensorSpec(name, weights.info(name).dtype, weights.info(name).shape, data)
    new = write_full_snapshot(tensors, tmp_path / "new", pair[0] / "config.json")
    write_delta(pair[0], new, tmp_path / "delta", version="2", base_version="1")
    client = seaweed.s3_client()
    upload_dir(client, tmp_path / "delta", seaweed.bucket, "snapshot-tests/sparse/delta")
    upload_dir(client, pair[0], seaweed.bucket, "snapshot-tests/sparse/base")
    delta_uri = snapshot_uri(seaweed.bucket, "snapshot-tests/sparse", "delta")
    base_uri = snapshot_uri(seaweed.bucket, "snapshot-tests/sparse", "base")
    plan = read_delta_plan(tmp_path / "delta")
    assert sorted(plan.tensors) == sorted(changed)
    frames = sorted((t.file, t.begin, t.wire_bytes) for t in plan.tensors.values())
    counter = GetCounter(client)

    def delta_gets() -> list[tuple[str, int, int]]:
        gets = counter.under("snapshot-tests/sparse/delta/")
        index = [g for g in gets if g[0].endswith(INDEX)]
        assert [g[1] for g in index] == [None] and index[0][2] == (tmp_path / "delta" / INDEX).stat().st_size
        shard_gets = [g for g in gets if not g[0].endswith(INDEX)]
        assert sum(g[2] for g in shard_gets) == sum(r[2] for r in ranges(shard_gets))  # each got what it asked
        return ranges(shard_gets)

    expected = sorted(_probes(plan.files) + frames)
    weights.apply_delta(delta_uri, s3=client)
    assert delta_gets() == expected
    assert weights.checksums() == HostWeights.load(new).checksums()

    counter.clear()
    out = materialize_chain(pair[0], [delta_uri], tmp_path / "out", s3=client)
    assert delta_gets() == expected
    fetched = sum(g[2] for g in counter.gets)
    assert fetched == (tmp_path / "delta" / INDEX).stat().st_size + sum(r[2] for r in expected)
    assert fetched < weights.total_bytes // 10
    assert raw_bytes(HostWeights.load(out)) == raw_bytes(HostWeights.load(new))

    counter.clear()
    out = materialize_chain(base_uri, [delta_uri], tmp_path / "out2", s3=client)
    assert delta_gets() == expected
    layout = read_full_layout(pair[0])
    base_shard_gets = [g for g in counter.under("snapshot-tests/sparse/base/") if g[0].endswith(".safetensors")]
    tensor_ranges = sorted((shard, e.begin, e.nbytes) for shard, e in layout.tensors.values() if e.nbytes)
    assert ranges(base_shard_gets) == sorted(_probes(layout.files) + tensor_ranges)
    assert raw_bytes(HostWeights.load(out)) == raw_bytes(HostWeights.load(new))
