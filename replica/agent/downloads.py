"""Objects of a bucket copied to local files (a model, a delta link's files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def download_prefix(s3: Any, bucket: str, prefix: str, dest: Path) -> int:
    """Copy the top-level objects under `prefix/` into `dest`; returns bytes downloaded."""
    dest.mkdir(parents=True, exist_ok=True)
    prefix = prefix.strip("/") + "/"
    total = 0
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix):]
            if not name or "/" in name:
                continue
            target = dest / name
            if not target.exists() or target.stat().st_size != obj["Size"]:
                tmp = target.with_suffix(target.suffix + ".part")
                s3.download_file(bucket, obj["Key"], str(tmp))
                tmp.replace(target)
                total += obj["Size"]
    if not any(dest.iterdir()):
        raise FileNotFoundError(f"no objects under s3://{bucket}/{prefix}")
    return total
