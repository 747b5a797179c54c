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
- ``await swap_held_then_refused_then_proven(engine, base_dir, counting_dir, changed)``: the
  engine-side swap a replica's agent calls, checked the same way on either engine kind.
- ``await fixed_answer(engine, model)``: a fixed greedy completion with its top-5 logprobs, what
  a test compares before and after a change to an engine's weights.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from replica.agent.engine_process import EngineProcess
from replica.engine.tensors import adler32_hex
from workers.base_model import checkpoint_files, load_checkpoint

_LABELS = itertools.count(1)


def files_of(source: Path | Sequence[Path]) -> list[Path]:
    return checkpoint_files(source) if isinstance(source, Path) else list(source)


async def stage(
    engine: EngineProcess,
    source: Path | Sequence[Path],
    label: str,
    names: Sequence[str] | None = None,
    expected: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    return await engine.stage_from_files(label, files_of(source), names, expected)


async def swap_in_pause(
    engine: EngineProcess, label: str, version: str | None = None, clear_cache: bool = False
) -> dict[str, Any]:
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


async def load(
    engine: EngineProcess,
    source: Path | Sequence[Path],
    names: Sequence[str] | None = None,
    expected: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    label = f"test-load-{next(_LABELS)}"
    staged = await stage(engine, source, label, names, expected)
    return {**staged, **await swap_in_pause(engine, label)}


async def swap_held_then_refused_then_proven(
    engine: EngineProcess, base_dir: Path, counting_dir: Path, changed: Sequence[str]
) -> dict[str, Any]:
    """The engine-side swap (`replica.engine.swap`), as a replica's agent calls it
    (``engine.swap_in_pause``), on any engine kind: held after its write and refused there (the
    "swap" fault point's failure: paused and labelled while held, then the label, the weights
    and the serving state as before), held and let go on (proven), then once more not held.
    Ends on ``base_dir``'s weights labelled "v-base"; returns the last swap's report."""
    await load(engine, base_dir)
    await engine.set_weight_version("v-base")
    base = await engine.checksums()
    counting = {n: adler32_hex(t) for n, t in load_checkpoint(counting_dir).items() if n in set(changed)}
    seen: list[tuple[bool, str | None]] = []

    async def look() -> None:
        seen.append((await engine.is_paused(), await engine.weight_version()))

    async def refuse() -> None:
        await look()
        raise RuntimeError("refused while held")

    await stage(engine, counting_dir, "v-counting", changed, counting)
    with pytest.raises(RuntimeError, match="refused while held"):
        await engine.swap_in_pause("v-counting", "v-base", clear_cache=False, expected=len(counting), while_held=refuse)
    assert seen == [(True, "v-counting")], seen
    assert (await engine.is_paused(), await engine.weight_version(), await engine.checksums()) == (
        False,
        "v-base",
        base,
    )

    await stage(engine, counting_dir, "v-counting", changed, counting)
    held = await engine.swap_in_pause(
        "v-counting", "v-base", clear_cache=False, expected=len(counting), while_held=look
    )
    assert seen[1] == (True, "v-counting") and held["verified"] == len(counting), (seen, held)
    assert await engine.weight_version() == "v-counting" and not await engine.is_paused()
    assert {n: c for n, c in (await engine.checksums()).items() if n in counting} == counting

    base_sums = {n: base[n] for n in counting}
    await stage(engine, base_dir, "v-base", changed, base_sums)
    report = await engine.swap_in_pause("v-base", "v-counting", clear_cache=False, expected=len(counting))
    assert report["verified"] == len(counting)
    assert set(report["timings_ms"]) == {"pause", "label", "swap", "resume", "window"}, report
    assert (await engine.weight_version(), await engine.checksums()) == ("v-base", base)
    return report


async def fixed_answer(engine: Any, model: str) -> dict[str, Any]:
    """``engine``'s (anything with our engines' ``request``) greedy completion of a fixed prompt
    as ``model``: its text and top-5 logprobs (a fresh cache salt: no prefix reuse)."""
    body = {
        "model": model,
        "prompt": [100, 101, 102],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
        "cache_salt": uuid.uuid4().hex,
    }
    choice = (await engine.request("POST", "/v1/completions", json=body)).json()["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]["top_logprobs"]}
