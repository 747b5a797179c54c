"""The engine's weight map (replica/engine/weight_map.py) on small torch models whose
``load_weights`` does what vLLM's loaders do (fused rows, a widened bias, a tied second name) or
what cannot be written in place (arithmetic on the tensor, a parameter transformed after
loading, a quantized engine): no vLLM. The families' real loaders: tests/replica/test_landings.py
and the engine tests."""

from __future__ import annotations

import pytest
import torch

from contracts.engine_ranks import HELD_BY_NO_RANK
from replica.engine import tensors as tensor_bytes
from replica.engine.stage import proof
from replica.engine.tensors import ChecksumPlan, adler32_combine, adler32_hex, adler32_slices
from replica.engine.weight_map import WeightMap
from tests.helpers.expert_models import Experts, expert_checkpoint, loaded

BF16 = torch.bfloat16


class Fused(torch.nn.Module):
    """q and k land in rows of one fused parameter, as vLLM's ``qkv_proj``; a float32 bias is
    loaded from the checkpoint's BF16 (widened); ``lm_head`` is tied to ``embed``."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(12, 4, dtype=BF16), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(12, dtype=torch.float32), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(6, 4, dtype=BF16), requires_grad=False)
        self.scaled = torch.nn.Parameter(torch.zeros(4, dtype=BF16), requires_grad=False)

    def load_weights(self, weights) -> None:
        rows = {"q": (0, 8), "k": (8, 4)}
        for name, t in weights:
            if name in ("q.weight", "k.weight"):
                start, n = rows[name[0]]
                self.qk.data.narrow(0, start, n).copy_(t)
            elif name == "qk.bias":
                self.bias.data.copy_(t)
            elif name == "embed.weight":
                self.embed.data.copy_(t)
            elif name == "lm_head.weight":
                pass  # tied: vLLM's loader skips it
            elif name == "scaled.weight":
                self.scaled.data.copy_(t * 2)  # not a copy of the checkpoint's bytes
            else:
                raise KeyError(name)


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q.weight": torch.randn(8, 4, generator=gen).to(BF16),
        "k.weight": torch.randn(4, 4, generator=gen).to(BF16),
        "qk.bias": torch.randn(12, generator=gen).to(BF16),
        "embed.weight": torch.randn(6, 4, generator=gen).to(BF16),
        "lm_head.weight": torch.randn(6, 4, generator=gen).to(BF16),
        "scaled.weight": torch.randn(4, generator=gen).to(BF16),
    }


def test_fused_rows_a_widened_bias_and_what_cannot_be_taken() -> None:
    base = checkpoint(0)
    wmap = loaded(Fused(), base)
    assert sorted(wmap.names()) == ["embed.weight", "k.weight", "q.weight", "qk.bias"]
    refused = {n: e.refused for n, e in wmap.entries.items() if e.refused}
    assert "keeps none of it" in refused["lm_head.weight"]
    assert "does more than copy it" in refused["scaled.weight"]
    # What the engine holds reads back as the checkpoint's bytes, in its dtype (the bias narrowed back).
    for name in wmap.names():
        assert adler32_hex(wmap.held(name)) == adler32_hex(base[name]), name
    assert wmap.whole("q.weight") is not None and wmap.whole("qk.bias") is None  # a view / a copy

    new = checkpoint(1)
    update = [(n, new[n]) for n in wmap.names()]
    wmap.check(update)
    wmap.write(update)
    assert all(wmap.holds(n, t) for n, t in update)
    assert torch.equal(wmap.model.qk[8:].float(), new["k.weight"].float())
    assert torch.equal(wmap.model.bias, new["qk.bias"].to(torch.float32))
    assert not wmap.holds("q.weight", base["q.weight"])


def test_staging_refuses_by_name_what_cannot_load_in_place() -> None:
    wmap = loaded(Fused(), checkpoint(0))
    new = checkpoint(1)
    cases = {
        "lm_head.weight: the engine's loader keeps none of it": [("lm_head.weight", new["lm_head.weight"])],
        "scaled.weight: the engine's loader does more than copy it": [("scaled.weight", new["scaled.weight"])],
        "v.weight: no such tensor in the engine's checkpoint": [("v.weight", new["k.weight"])],
        r"k.weight: shape \(8, 4\) != engine \(4, 4\)": [("k.weight", new["q.weight"])],
        # A bias the engine holds in float32 still takes only the checkpoint's BF16 (no relabelling).
        "qk.bias: dtype float32 != engine bfloat16": [("qk.bias", new["qk.bias"].float())],
        "q.weight: given twice": [("q.weight", new["q.weight"])] * 2,
    }
    for message, tensors in cases.items():
        with pytest.raises(ValueError, match=f"refusing to load .*{message}"):
            wmap.check(tensors)


def test_a_tensor_refused_after_the_map_is_built_is_refused_at_staging_by_name() -> None:
    """What the agent finds no rank holds (`combine_map`'s orphans) every rank refuses: staging
    names it and the reason, and the rank holds, writes and proves nothing of it."""
    wmap = loaded(Fused(), checkpoint(0))
    wmap.refuse(["k.weight"], HELD_BY_NO_RANK)
    assert "k.weight" not in wmap.names() and "k.weight" not in wmap.elsewhere()
    with pytest.raises(
        ValueError, match=r"refusing to load \(1 problem\(s\)\): k.weight: no rank of the engine holds it"
    ):
        wmap.check([("k.weight", checkpoint(1)["k.weight"]), ("q.weight", checkpoint(1)["q.weight"])])


def test_a_narrowing_a_transform_after_loading_and_a_quantized_engine_are_refused() -> None:
    base = checkpoint(0)
    narrowed = dict(base, **{"qk.bias": base["qk.bias"].to(torch.float64)})
    wmap = loaded(Fused(), narrowed)
    assert "converts it float64 -> float32 (bias), not losslessly" in wmap.entries["qk.bias"].refused

    model = Fused()
    model.load_weights(list(base.items()))
    model.embed.data.mul_(2)  # transformed after loading (a repack): a copy into it would be wrong
    wmap = WeightMap.build(model, [(n, tuple(t.shape), t.dtype) for n, t in base.items()], base.__getitem__)
    assert (
        "cannot be written in place: embed does not hold what its loader wrote" in wmap.entries["embed.weight"].refused
    )
    assert "q.weight" in wmap.names()

    wmap = loaded(Fused(), base, quantization="fp8")
    assert wmap.names() == []
    with pytest.raises(ValueError, match="q.weight: the engine runs a fp8-quantized checkpoint"):
        wmap.check([("q.weight", base["q.weight"])])


def test_a_rank_holding_a_slice_writes_and_proves_it_but_cannot_read_the_tensor_whole() -> None:
    class Rank1(torch.nn.Module):
        """Rank 1 of 2: the second half of the rows (a column-parallel layer's shard)."""

        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, 4, dtype=BF16), requires_grad=False)

        def load_weights(self, weights) -> None:
            for _, t in weights:
                self.w.data.copy_(t.narrow(0, 4, 4))

    full = torch.randn(8, 4).to(BF16)
    wmap = loaded(Rank1(), {"w.weight": full})
    with pytest.raises(ValueError, match="w.weight: this rank holds only a slice of it"):
        wmap.held("w.weight")
    new = torch.randn(8, 4).to(BF16)
    wmap.write([("w.weight", new)])
    assert wmap.holds("w.weight", new) and torch.equal(wmap.model.w, new[4:])


class Counting(Fused):
    """:class:`Fused` counting its ``load_weights`` calls; ``buffered``: it takes every tensor of
    a call before loading any (a loader that does not stream)."""

    def __init__(self, buffered: bool = False) -> None:
        super().__init__()
        self.calls = 0
        self.buffered = buffered

    def load_weights(self, weights) -> None:
        self.calls += 1
        super().load_weights(list(weights) if self.buffered else weights)


def test_many_tensors_are_observed_per_loader_call_and_each_problem_stays_its_own() -> None:
    """One ``load_weights`` call observes a whole batch; a batch holding ``scaled.weight``
    (arithmetic) is split down to it, so it alone is refused and every other tensor keeps its
    landings. A loader that does not stream is observed a tensor at a time: the same map."""
    clean = {n: t for n, t in checkpoint().items() if n != "scaled.weight"}
    model = Counting()
    loaded(model, clean)
    assert model.calls == 2  # the load, then one call observing all five tensors
    maps = {}
    for buffered in (False, True):
        model = Counting(buffered)
        wmap = loaded(model, checkpoint())
        maps[buffered] = {n: (e.refused, e.landings) for n, e in wmap.entries.items()}
        assert "does more than copy it" in (wmap.entries["scaled.weight"].refused or "")
        assert sorted(wmap.names()) == ["embed.weight", "k.weight", "q.weight", "qk.bias"]
    assert maps[False] == maps[True]


def proof_per_tensor(wmap: WeightMap, tensors: list[tuple[str, torch.Tensor]], expected: dict[str, str]) -> list[str]:
    """The proof as it was before the per-parameter read: one view and one Adler-32 per tensor."""
    return [n for n, _ in tensors if adler32_hex(wmap.whole(n)) != expected[n]]


def test_the_proof_reads_each_fused_parameter_once_with_the_per_tensor_answer() -> None:
    wmap = loaded(Experts(), expert_checkpoint(0))
    new = expert_checkpoint(1)
    update = [(n, new[n]) for n in sorted(new)]
    expected = {n: adler32_hex(t) for n, t in update}
    wmap.write(update)
    groups, rest = wmap.host_slices(n for n, _ in update)
    # Every tensor is a slice of one of the three parameters' bytes: none is proven on its own.
    assert rest == [] and sorted(len(slices) for _, slices in groups) == [1, 8, 16]
    assert proof(wmap, update, expected) == ([], expected) and proof_per_tensor(wmap, update, expected) == []

    # One byte flipped in the up rows of expert 5: that tensor alone differs, by both forms.
    raw = wmap.target("w13").view(-1).view(torch.uint8)
    at = (5 * 2 * Experts.INTER + Experts.INTER) * Experts.H * 2 + 3
    raw[at] ^= 0x10
    bad, held = proof(wmap, update, expected)
    assert bad == ["experts.5.up_proj.weight"] == proof_per_tensor(wmap, update, expected)
    assert len(held) == len(update) - 1


def test_a_proof_laid_out_before_the_swap_reads_the_parameters_where_they_are_when_it_runs() -> None:
    """The stage lays its host checksums out when taken (`WeightMap.host_proof`); the proof in the
    pause sums what the engine holds then. A parameter vLLM replaced since (other storage) makes it
    lay them out again: the old bytes are never what it proves."""
    wmap = loaded(Experts(), expert_checkpoint(0))
    new = expert_checkpoint(1)
    update = [(n, new[n]) for n in sorted(new)]
    expected = {n: adler32_hex(t) for n, t in update}
    host = wmap.host_proof(n for n, _ in update)
    assert host.rest == [] and host.current(wmap)
    wmap.write(update)
    assert proof(wmap, update, expected, host=host) == ([], expected)
    # w13 moved to new storage (as vLLM's replace_parameter does), holding the update but one byte.
    param = wmap.model.get_parameter("w13")
    param.data = param.data.clone()
    raw = param.data.view(-1).view(torch.uint8)
    raw[(5 * 2 * Experts.INTER + Experts.INTER) * Experts.H * 2 + 3] ^= 0x10
    assert not host.current(wmap)
    bad, _ = proof(wmap, update, expected, host=host)
    assert bad == ["experts.5.up_proj.weight"]


def test_a_proof_laid_out_with_its_sums_names_each_tensor_that_differs() -> None:
    """Laid out with the expected sums (as a stage is taken), the proof compares the whole list
    at once: equal, every tensor is proven; one byte off, exactly its tensor is named."""
    wmap = loaded(Experts(), expert_checkpoint(0))
    new = expert_checkpoint(1)
    update = [(n, new[n]) for n in sorted(new)]
    expected = {n: adler32_hex(t) for n, t in update}
    host = wmap.host_proof((n for n, _ in update), expected)
    assert host.want is not None and len(host.want) == len(update)
    wmap.write(update)
    assert proof(wmap, update, expected, host=host) == ([], expected)
    raw = wmap.target("w13").view(-1).view(torch.uint8)
    raw[(2 * 2 * Experts.INTER) * Experts.H * 2 + 1] ^= 0x01  # the gate rows of expert 2
    bad, held = proof(wmap, update, expected, host=host)
    assert bad == ["experts.2.gate_proj.weight"] and set(held) == set(expected) - set(bad)


def test_adler32_of_slices_equals_each_tensor_s_own() -> None:
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (64, 1000), dtype=torch.uint8, generator=gen)
    slices = [(str(i), i * 1000, (i + 1) * 1000) for i in range(64)]
    got = dict(adler32_slices(data.reshape(-1).numpy().data, slices))
    assert got == {str(i): adler32_hex(data[i]) for i in range(64)}


def test_adler32_on_every_core_equals_zlib_s_of_each_slice(monkeypatch) -> None:
    """The proof's Adler-32 cut into pieces summed on several threads and combined: equal to one
    pass over each slice (slices spanning many pieces, one shorter than a piece, one empty)."""
    monkeypatch.setattr(tensor_bytes, "PIECE_BYTES", 1009)
    monkeypatch.setattr(tensor_bytes, "CHECKSUM_THREADS", 2)
    gen = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (100_000,), dtype=torch.uint8, generator=gen)
    other = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen)
    slices = [("all", 0, 100_000), ("short", 7, 500), ("empty", 30, 30), ("tail", 98_000, 100_000)]
    got = ChecksumPlan([(data.numpy().data, slices), (other.numpy().data, [("other", 0, 5000)])]).run()
    want = {n: adler32_hex(data[a:b]) for n, a, b in slices} | {"other": adler32_hex(other)}
    assert got == want and want["all"] != want["tail"]
    assert adler32_combine(int(want["short"], 16), 1, 0) == int(want["short"], 16)  # B empty: A's
    # Many slices smaller than a piece (an MoE layer's experts): summed a run of them per task.
    experts = [(f"e{i}", 40 * i, 40 * i + 40) for i in range(2000)]
    plan = ChecksumPlan([(data.numpy().data, experts)])
    assert 2 < len(plan.batches) < 100 and sum(map(len, plan.batches)) == len(experts)
    assert plan.run() == {n: adler32_hex(data[a:b]) for n, a, b in experts}
