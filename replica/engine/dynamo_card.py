"""Where Dynamo's frontend reads a ``dynamo-vllm`` replica's model files (config, tokenizer,
generation config): in the shared ``file`` discovery directory, never from the worker's host.

Dynamo's worker would name them as URLs on its loopback-only system server, which a frontend on
another host cannot fetch. With the ``file`` backend, :func:`install` registers the card from a
weightless copy at ``DYN_FILE_KV/rollouts-model-files/<digest>`` (digest of names and contents:
one per distinct model, written once via a rename, never changed), ``self_host_metadata=False``.
The worker still loads weights from its own ``--model``. The ``kubernetes`` backend keeps
Dynamo's URLs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

FILES_DIR = "rollouts-model-files"
# What the card never reads: the weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def metadata_files(model_dir: Path) -> list[Path]:
    """The model's files, weights left out, in name order."""
    return sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES))


def shared_copy(model_dir: Path, discovery_dir: Path) -> Path:
    """The copy of ``model_dir``'s files without weights under ``discovery_dir`` (made if absent)."""
    files = metadata_files(model_dir)
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    target = discovery_dir / FILES_DIR / digest.hexdigest()[:32]
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=target.parent))
    try:
        for path in files:
            shutil.copyfile(path, staging / path.name)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # another worker's copy won the rename; anything else is an error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def shared_registration(register_model: Callable[..., Any], discovery_dir: Path) -> Callable[..., Any]:
    """``register_model`` with the card built from :func:`shared_copy` and not self-hosted."""

    async def register(
        model_input: Any, model_type: Any, endpoint: Any, model_path: str, *args: Any, **kwargs: Any
    ) -> Any:
        if Path(model_path).is_dir():
            model_path = str(shared_copy(Path(model_path), discovery_dir))
            kwargs["self_host_metadata"] = False
        return await register_model(model_input, model_type, endpoint, model_path, *args, **kwargs)

    return register


def install(worker_main: Any) -> bool:
    """With the ``file`` discovery backend, make ``worker_main`` (``dynamo.vllm.main``) register
    its card from the shared directory. Returns whether it did."""
    discovery_dir = os.environ.get("DYN_FILE_KV")
    if os.environ.get("DYN_DISCOVERY_BACKEND") != "file" or not discovery_dir:
        return False
    worker_main.register_model = shared_registration(worker_main.register_model, Path(discovery_dir))
    return True
