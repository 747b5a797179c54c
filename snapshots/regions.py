"""What a tensor-parallel engine serves, checked against a checkpoint, shard by shard.

Each rank of an engine reports a checksum for every tensor it holds whole, and for a tensor it
holds a shard of, each region of the checkpoint tensor it holds (``[size], [stride], offset`` in
elements, row-major, as ``torch.as_strided`` takes them) with the checksum of the bytes it holds
there. :meth:`ServedWeights.combine` merges the ranks' answers; :meth:`ServedWeights.differing`
names the tensors whose served bytes are not the expected ones: a whole tensor's checksum, each
region's bytes against the same region of the expected tensor, and the ranks' regions together
covering the whole tensor (tensor-parallel shards partition a tensor or repeat it whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from snapshots.codec import adler32_hex

Region = tuple[tuple[int, ...], tuple[int, ...], int]


def region_checksum(t: torch.Tensor, region: Region) -> str:
    """Adler-32 (8 hex digits) of ``region`` of ``t``'s row-major elements."""
    size, stride, offset = region
    flat = t.detach().to("cpu").contiguous().view(-1)
    part = flat.as_strided(size, stride, flat.storage_offset() + offset).contiguous()
    return adler32_hex(part.view(-1).view(torch.uint8).numpy() if part.numel() else b"")


@dataclass
class ServedWeights:
    checksums: dict[str, str] = field(default_factory=dict)  # tensors a rank holds whole
    regions: dict[str, dict[Region, set[str]]] = field(default_factory=dict)  # the others: region -> checksums

    @classmethod
    def combine(cls, answers: Sequence[Mapping[str, Any]]) -> ServedWeights:
        """Merge the ranks' ``{"checksums", "regions"}``; ValueError naming a tensor two ranks
        hold whole with different bytes."""
        out = cls()
        for rank, answer in enumerate(answers):
            for name, digest in answer.get("checksums", {}).items():
                if out.checksums.setdefault(name, digest) != digest:
                    raise ValueError(
                        f"{name}: the engine's ranks hold different bytes (rank {rank}: {digest}, "
                        f"an earlier rank: {out.checksums[name]})"
                    )
            for name, pieces in answer.get("regions", {}).items():
                held = out.regions.setdefault(name, {})
                for size, stride, offset, digest in pieces:
                    held.setdefault((tuple(size), tuple(stride), int(offset)), set()).add(str(digest))
        return out

    def differing(
        self, names: Iterable[str], expected: Mapping[str, str], tensor: Callable[[str], torch.Tensor]
    ) -> list[str]:
        """Of ``names``, those served other than expected: by ``expected`` checksum when a rank
        holds the tensor whole, else region by region against ``tensor(name)``."""
        wrong = []
        for name in names:
            if name in self.checksums:
                ok = self.checksums[name] == expected.get(name)
            elif name in self.regions:
                want = tensor(name)
                pieces = self.regions[name]
                ok = sum(math.prod(size) for size, _, _ in pieces) == want.numel() and all(
                    digests == {region_checksum(want, region)} for region, digests in pieces.items()
                )
            else:
                ok = False
            if not ok:
                wrong.append(name)
        return wrong
