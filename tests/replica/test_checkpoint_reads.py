"""The engine's checkpoint reads cost per file, not per tensor (replica/engine/files.py
``Checkpoint``): building the weight map of a checkpoint of a few hundred tensors in three
shards opens each shard at most once to list its tensors and once to read them back for the
map's proof, and reads each shard's tensors in the order their bytes lie in it. An open per
tensor parses the shard's whole header each time (quadratic in the tensors of a file: minutes
at Qwen3-30B-A3B's 18,867 tensors). No vLLM: a torch model whose loader copies each tensor into
its own parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from replica.engine import files
from replica.engine.files import Checkpoint
from replica.engine.weight_map import WeightMap

SHARDS, PER_SHARD = 3, 120


class Flat(torch.nn.Module):
    """One parameter per checkpoint tensor; ``load_weights`` copies each into its own."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.slots = {n: f"p{i}" for i, n in enumerate(names)}
        for n, attr in self.slots.items():
            self.register_parameter(
                attr, torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16), requires_grad=False)
            )

    def load_weights(self, weights) -> None:
        for name, t in weights:
            getattr(self, self.slots[name]).data.copy_(t)


def write_shards(root: Path) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for s in range(SHARDS):
        shard = {f"layers.{s}.w{i:03d}": torch.randn(4, 3, generator=gen).to(torch.bfloat16) for i in range(PER_SHARD)}
        save_file(shard, str(root / f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"))
        tensors.update(shard)
    return tensors


class Counted:
    """Counts the opens of ``*.safetensors`` files through ``files``' ``safe_open`` and ``open``,
    and the order in which tensors are read from each open handle."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opens: list[str] = []
        self.reads: list[str] = []
        real_safe_open, counter = files.safe_open, self

        class Handle:
            def __init__(self, path: str, *args, **kwargs) -> None:
                counter.opens.append(path)
                self._f = real_safe_open(path, *args, **kwargs)

            def __enter__(self):
                self._f.__enter__()
                return self

            def __exit__(self, *exc):
                return self._f.__exit__(*exc)

            def get_tensor(self, name: str) -> torch.Tensor:
                counter.reads.append(name)
                return self._f.get_tensor(name)

            def __getattr__(self, attr):
                return getattr(self._f, attr)

        def counting_open(path, *args, **kwargs):
            if str(path).endswith(".safetensors"):
                self.opens.append(str(path))
            return open(path, *args, **kwargs)

        monkeypatch.setattr(files, "safe_open", Handle)
        monkeypatch.setattr(files, "open", counting_open, raising=False)

    def take(self) -> tuple[list[str], list[str]]:
        out = (self.opens, self.reads)
        self.opens, self.reads = [], []
        return out


def test_the_weight_map_opens_each_shard_once_per_phase_and_reads_in_file_order(tmp_path, monkeypatch) -> None:
    tensors = write_shards(tmp_path)
    model = Flat(list(tensors))
    model.load_weights(list(tensors.items()))  # the engine just loaded from this checkpoint
    counted = Counted(monkeypatch)

    checkpoint = Checkpoint(tmp_path)
    opens, _ = counted.take()
    assert len(checkpoint.specs) == SHARDS * PER_SHARD
    assert len(opens) <= SHARDS, f"listing the tensors opened files {len(opens)} times"

    wmap = WeightMap.build(model, checkpoint.specs, checkpoint.read)
    opens, reads = counted.take()
    assert sorted(wmap.names()) == sorted(tensors)  # every tensor read back and proven held
    assert len(opens) <= SHARDS, f"the proof opened files {len(opens)} times for {len(reads)} tensors"
    # Each shard's tensors read in the order their bytes lie in the file (its header's offsets).
    header_order = [n for path in sorted(tmp_path.glob("*.safetensors")) for n, _, _ in files._header_specs(str(path))]
    assert reads == header_order


def test_a_checkpoint_reads_back_what_was_written_and_names_a_bad_file(tmp_path) -> None:
    tensors = write_shards(tmp_path)
    with Checkpoint(tmp_path) as checkpoint:
        assert {n: (s, d) for n, s, d in checkpoint.specs} == {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
        for name in ("layers.0.w000", "layers.2.w119", "layers.1.w007"):
            assert torch.equal(checkpoint.read(name), tensors[name])
    (tmp_path / "broken.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="broken.safetensors"):
        Checkpoint(tmp_path)
