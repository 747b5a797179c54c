"""Helpers for the snapshots tests: hand-made deltas, checkpoint mutation, a fake S3 client.

Everything here is a few MB at most; the realistic large generator is for bench/ only.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from snapshots.host import HostWeights
from snapshots.safetensors_io import TensorSpec, write_safetensors
from snapshots.writer import write_full_snapshot

REPO = Path(__file__).resolve().parents[2]
INDEX = "model.safetensors.index.json"
DELTA_META = {
    "version": "000001",
    "base_version": "000000",
    "delta_encoding": "xor",
    "compression_format": "zstd",
    "checksum_format": "adler32",
}


def adler(buf: Any) -> str:
    return f"{zlib.adler32(buf):08x}"


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def mutate_checkpoint(src: Path, dst: Path, *, seed: int, fraction: float = 0.02, skip: int = 3) -> Path:
    """Write ``src`` with ~``fraction`` of the bytes of every ``skip``-th-skipped tensor changed."""
    weights = HostWeights.load(src)
    rng = np.random.default_rng(seed)
    tensors = {}
    for i, name in enumerate(weights.names()):
        info = weights.info(name)
        data = weights.raw(name).copy()
        if i % skip and data.size:
            idx = rng.integers(0, data.size, max(1, int(data.size * fraction)))
            data[idx] ^= rng.integers(1, 256, idx.size, dtype=np.uint8)
        tensors[name] = TensorSpec(name, info.dtype, info.shape, data)

    write_full_snapshot(tensors, dst, src / "config.json")
    return dst


def write_delta_dir(
    out: Path,
    frames: Mapping[str, bytes],
    checksums: Mapping[str, str | None],
    *,
    metadata: Mapping[str, Any] | None = None,
    shard: str = "model-00000-of-00001.safetensors",
    dtype: str = "U8",
) -> Path:
    """A hand-made delta: one shard holding ``frames``; a ``None`` checksum is left out."""
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for name, frame in frames.items():
        shape = (len(frame),) if dtype == "U8" else (len(frame) // 2,)
        specs.append(TensorSpec(name, dtype, shape, frame))
    write_safetensors(out / shard, specs, {n: c for n, c in checksums.items() if c is not None})
    meta = dict(DELTA_META if metadata is None else metadata)
    (out / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": dict.fromkeys(frames, shard)}))
    return out


def xor_frame(old: np.ndarray, new: np.ndarray, **kwargs: Any) -> bytes:
    return zstandard.ZstdCompressor(level=1, **kwargs).compress((old ^ new).tobytes())


def raw_bytes(weights: HostWeights) -> dict[str, bytes]:
    return {n: weights.raw(n).tobytes() for n in weights.names()}


# ------------------------------------------------------------------------------ fake S3


class FakeS3Error(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class FakeS3:
    """The slice of boto3's S3 client the package uses, over a local ``root/BUCKET/KEY`` tree.

    It answers like S3: listings are paginated (``page_size`` keys a page), honour
    ``Delimiter`` and give each object's ETag (the MD5 of its bytes, as a single-part upload's); ``Range`` reads return
    exactly the asked bytes; a missing key raises an error whose ``response`` carries ``NoSuchKey``. Every call is
    logged in ``calls``.
    """

    def __init__(self, root: Path, page_size: int = 2) -> None:
        self.root = root
        self.page_size = page_size
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def list_objects_v2(
        self,
        *,
        Bucket: str,
        Prefix: str = "",
        Delimiter: str | None = None,
        ContinuationToken: str | None = None,
        **_: Any,
    ) -> dict[str, Any]:
        self.calls.append(("list_objects_v2", {"Prefix": Prefix}))
        base = self.root / Bucket
        keys = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())
        keys = [k for k in keys if k.startswith(Prefix)]
        contents, prefixes = [], set()
        for key in keys:
            rest = key[len(Prefix) :]
            if Delimiter and Delimiter in rest:
                prefixes.add(Prefix + rest.split(Delimiter)[0] + Delimiter)
            else:
                data = (base / key).read_bytes()
                contents.append({"Key": key, "Size": len(data), "ETag": f'"{hashlib.md5(data).hexdigest()}"'})
        start = int(ContinuationToken or 0)
        page = contents[start : start + self.page_size]
        answer: dict[str, Any] = {"Contents": page, "CommonPrefixes": [{"Prefix": p} for p in sorted(prefixes)]}
        if start + self.page_size < len(contents):
            answer.update(IsTruncated=True, NextContinuationToken=str(start + self.page_size))
        else:
            answer["IsTruncated"] = False
        return answer

    def get_object(self, *, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        self.calls.append(("get_object", {"Key": Key, "Range": Range}))
        path = self.root / Bucket / Key
        if not path.is_file():
            raise FakeS3Error("NoSuchKey")
        data = path.read_bytes()
        if Range is not None:
            first, last = (int(x) for x in Range.removeprefix("bytes=").split("-"))
            if first >= len(data):
                raise FakeS3Error("InvalidRange")
            data = data[first : last + 1]
        return {"Body": io.BytesIO(data), "ContentLength": len(data)}


# ------------------------------------------------------------------------------ real S3


class GetCounter:
    """Records every GetObject a real boto3 client makes: key, Range header, bytes returned.

    Hooks the client's own event system (no stand-in: the requests still go to the server).
    """

    def __init__(self, client: Any) -> None:
        self.gets: list[tuple[str, str | None, int]] = []
        client.meta.events.register("before-parameter-build.s3.GetObject", self._request)
        client.meta.events.register("after-call.s3.GetObject", self._response)

    def _request(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["counted"] = (params["Key"], params.get("Range"))

    def _response(self, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        key, byte_range = context["counted"]
        self.gets.append((key, byte_range, int(parsed.get("ContentLength", 0))))

    def clear(self) -> None:
        self.gets.clear()

    def under(self, prefix: str) -> list[tuple[str, str | None, int]]:
        return [g for g in self.gets if g[0].startswith(prefix)]


def ranges(gets: list[tuple[str, str | None, int]]) -> list[tuple[str, int, int]]:
    """``(file name, first byte, length)`` of ranged GETs, sorted."""
    out = []
    for key, byte_range, _ in gets:
        assert byte_range is not None, f"{key} was fetched whole"
        first, last = (int(x) for x in byte_range.removeprefix("bytes=").split("-"))
        out.append((key.rsplit("/", 1)[1], first, last - first + 1))
    return sorted(out)
