"""Putting weights into a real engine the way a replica does: stage, then swap and commit inside
one ``pause(keep)`` (the extension's one lifecycle, `replica.engine.stage`).

- ``await stage(engine, source, label, names=None, expected=None)``: stage a checkpoint (a model
  directory or a list of safetensors files; ``names`` only, else every tensor), checked against
  ``expected`` (name -> Adler-32) when given; the engine keeps serving its weights.
- ``await swap_in_pause(engine, label, version=None, clear_cache=False)``: inside one pause,
  relabel (``version``), swap the stage in and commit it (the read-back proof); on any failure
  the stage is discarded (rolled back) and the engine resumed. Returns the swap and commit
  reports merged (``copy_s``, ``verify_s``, ``verified``...).
- ``await load(engine, source, names=None, expected=None)``: both, for a test that only needs
  the engine to serve a checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from replica.agent.engine_process import EngineProcess
from workers.base_model import checkpoint_files

_LABELS = itertools.count(1)


def files_of(source: Path | Sequence[Path]) -> list[Path]:
    return checkpoint_files(source) if isinstance(source, Path) else list(source)


async def stage(engine: EngineProcess, source: Path | Sequence[Path], label: str,
                names: Sequence[str] | None = None, expected: Mapping[str, str] | None = None) -> dict[str, Any]:
    return await engine.stage_from_files(label, files_of(source), names, expected)


async def swap_in_pause(engine: EngineProcess, label: str, version: str | None = None,
                        clear_cache: bool = False) -> dict[str, Any]:
    await engine.pause(mode="keep", clear_cache=clear_cache)
    try:
        if version is not None:
            await engine.set_weight_version(version)
        try:
            report = await engine.swap_staged(label)
            report.update(await engine.commit_staged(label))
        except BaseException:
            with contextlib.suppress(Exception):
                await engine.discard_staged()
            raise
        return report
    finally:
        await engine.resume()


async def load(engine: EngineProcess, source: Path | Sequence[Path], names: Sequence[str] | None = None,
               expected: Mapping[str, str] | None = None) -> dict[str, Any]:
    label = f"test-load-{next(_LABELS)}"
    staged = await stage(engine, source, label, names, expected)
    return {**staged, **await swap_in_pause(engine, label)}
