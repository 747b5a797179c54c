"""A ``dynamo-vllm`` worker's model card names files in the shared discovery directory
(``replica.engine.dynamo_card``): unit level. The multihost scenarios prove that a frontend on
another host serves from such a card."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

from replica.engine import dynamo_card


def model_dir(root: Path, config: str = '{"a": 1}') -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(config)
    (root / "tokenizer.json").write_text('{"t": 2}')
    (root / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    return root


def test_the_copy_leaves_the_weights_out_and_is_made_once_per_content(tmp_path: Path) -> None:
    shared = tmp_path / "discovery"
    one = dynamo_card.shared_copy(model_dir(tmp_path / "one"), shared)
    assert one.parent == shared / dynamo_card.FILES_DIR
    assert sorted(p.name for p in one.iterdir()) == ["config.json", "tokenizer.json"]
    assert (one / "config.json").read_text() == '{"a": 1}'
    # The same files elsewhere (another node's copy of the model): the same directory, untouched.
    stamp = (one / "config.json").stat().st_mtime_ns
    assert dynamo_card.shared_copy(model_dir(tmp_path / "two"), shared) == one
    assert (one / "config.json").stat().st_mtime_ns == stamp
    # Other contents: another directory; nothing half-written is left beside them.
    other = dynamo_card.shared_copy(model_dir(tmp_path / "three", '{"a": 2}'), shared)
    assert other != one
    assert sorted(p.name for p in (shared / dynamo_card.FILES_DIR).iterdir()) == sorted([one.name, other.name])


async def test_registration_names_the_shared_copy_and_is_not_self_hosted(tmp_path: Path) -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def register_model(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "registered"

    model = model_dir(tmp_path / "model")
    register = dynamo_card.shared_registration(register_model, tmp_path / "discovery")
    assert await register("in", "type", "endpoint", str(model), "served", worker_type="agg") == "registered"
    ((args, kwargs),) = calls
    assert args[:3] == ("in", "type", "endpoint") and args[4] == "served"
    assert Path(args[3]).parent == tmp_path / "discovery" / dynamo_card.FILES_DIR
    assert kwargs == {"worker_type": "agg", "self_host_metadata": False}
    # A model that is not a local directory (a hub name) is registered as Dynamo would.
    await register("in", "type", "endpoint", "org/model")
    assert calls[-1] == (("in", "type", "endpoint", "org/model"), {})


def test_installed_only_with_the_file_backend(monkeypatch, tmp_path: Path) -> None:
    async def original(*args: Any, **kwargs: Any) -> None:
        return None

    main = types.SimpleNamespace(register_model=original)
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "kubernetes")
    monkeypatch.delenv("DYN_FILE_KV", raising=False)
    assert not dynamo_card.install(main) and main.register_model is original
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "file")
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    assert dynamo_card.install(main) and main.register_model is not original
