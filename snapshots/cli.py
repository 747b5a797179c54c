"""``rollouts snapshot ...``: inspect, write, apply and verify snapshots from the shell.

    rollouts snapshot inspect PATH_OR_S3 [--previous-identity ID]     # JSON description
    rollouts snapshot delta BASE NEW OUT --version V --base-version B  # JSON stats
    rollouts snapshot apply BASE DELTA [DELTA ...] --out DIR           # materialize a chain (streamed;
                                                                       # DIR may be BASE: in place)
    rollouts snapshot verify DIR --against OTHER                       # per-tensor Adler-32

``apply`` swaps the new checkpoint into DIR atomically and returns once it is there (and
synced); the files it replaced are removed by a detached ``rm`` after it returns
(snapshots/replace.py).

``OTHER`` may be a checkpoint (directory or ``s3://``) or a manifest JSON
(``{"tensors": {name: adler32}}``, as in ``_manifests/IDENTITY.json``).

:func:`main` returns the exit status: 0 on success, 1 with a one-line ``error: ...`` on stderr
for any failure (2 for usage errors, as argparse does). ``s3://`` locations use a boto3 client
built from the standard environment (``AWS_ENDPOINT_URL_S3`` or ``CW_S3_ENDPOINT``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from snapshots.errors import SnapshotError
from snapshots.host import checkpoint_checksums, compare_checksums
from snapshots.inspect import inspect_snapshot
from snapshots.replace import remove_in_background
from snapshots.storage import s3_client_from_env
from snapshots.stream import materialize_chain_report
from snapshots.writer import write_delta


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollouts snapshot", description="hot-load snapshot tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="validate a snapshot directory or s3:// prefix; print JSON")
    p.add_argument("location")
    p.add_argument("--previous-identity")
    p = sub.add_parser("delta", help="write the delta from BASE to NEW into OUT; print stats")
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("out")
    p.add_argument("--version", required=True)
    p.add_argument("--base-version", required=True)
    p.add_argument("--workers", type=int)
    p = sub.add_parser("apply", help="materialize BASE + DELTA... as a full checkpoint in --out")
    p.add_argument("base")
    p.add_argument("deltas", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int)
    p = sub.add_parser("verify", help="compare per-tensor Adler-32 of two checkpoints")
    p.add_argument("location")
    p.add_argument("--against", required=True)
    return parser


class _LazyS3:
    """Builds the S3 client on first use, so local-only commands never import boto3."""

    def __init__(self) -> None:
        self._client: Any = None

    def __call__(self, *locations: str) -> Any:
        if not any(str(loc).startswith("s3://") for loc in locations):
            return None
        if self._client is None:
            self._client = s3_client_from_env()
        return self._client


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _checksums_of(location: str, s3: _LazyS3) -> dict[str, str]:
    if location.endswith(".json") and Path(location).is_file():
        try:
            manifest = json.loads(Path(location).read_text())
            tensors = manifest["tensors"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SnapshotError(f"not a manifest with a 'tensors' object ({exc})", file=location) from None
        if not isinstance(tensors, dict):
            raise SnapshotError("manifest 'tensors' is not an object", file=location)
        return {str(k): str(v).lower() for k, v in tensors.items()}
    return checkpoint_checksums(location, s3=s3(location))


def _run(args: argparse.Namespace) -> int:
    s3 = _LazyS3()
    if args.command == "inspect":
        info = inspect_snapshot(args.location, s3=s3(args.location), previous_identity=args.previous_identity)
        _print_json(info.to_json())
        return 0
    if args.command == "delta":
        stats = write_delta(
            args.base, args.new, args.out, version=args.version, base_version=args.base_version, workers=args.workers
        )
        _print_json(stats.to_json())
        return 0
    if args.command == "apply":
        report = materialize_chain_report(
            args.base,
            args.deltas,
            args.out,
            s3=s3(args.base, *args.deltas),
            workers=args.workers,
            discard=remove_in_background,
        )
        _print_json(
            {
                "out": str(report.out),
                "tensors": report.tensors,
                "deltas": [
                    {
                        "location": r.location,
                        "version": r.version,
                        "changed": len(r.changed),
                        "wire_bytes": r.wire_bytes,
                    }
                    for r in report.deltas
                ],
            }
        )
        return 0
    if args.command == "verify":
        problems = compare_checksums(_checksums_of(args.location, s3), _checksums_of(args.against, s3))
        if problems:
            shown = "; ".join(problems[:10]) + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else "")
            print(f"error: {len(problems)} tensor(s) differ: {shown}", file=sys.stderr)
            return 1
        print("ok: every tensor matches")
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    """Run one ``rollouts snapshot`` command; returns the process exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on usage errors and --help
        return int(exc.code or 0)
    try:
        return _run(args)
    except (SnapshotError, OSError) as exc:
        print(f"error: {exc}".replace("\n", " "), file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the contract is one line, never a traceback
        print(f"error: {type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
