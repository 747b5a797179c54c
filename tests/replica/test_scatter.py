"""A delta's swap writes only the elements it changes (replica/engine/scatter.py), through the
same stage -> swap -> commit | discard lifecycle, on a model with vLLM's loader interface whose
landings are strided (q/k/v into columns of one fused parameter) and widened (a BF16 tensor in a
float32 parameter): no vLLM. The bytes inside the pause are counted and bounded by the changed
bytes; a failed read-back or another rank's failure rolls back exactly. On the host each tensor
goes the faster way (scattered below the crossover, whole above it), both proven and rolled back
exactly. On CPU tensors in ``make test``, on a CUDA device in ``make test-gpu``."""

from __future__ import annotations

import pytest
import torch

from replica.engine import scatter
from replica.engine.stage import StageSlot, take
from replica.engine.tensors import adler32_hex, flat_cat
from replica.engine.weight_map import Entry, WeightMap
from tests.helpers.devices import DEVICES
from tests.helpers.expert_models import Experts, expert_checkpoint, loaded

BF16 = torch.bfloat16
# A scattered element moves its value at the parameter's width plus its offset (int64 on the
# host, int32 on an accelerator): at most (4 + 8) / 2 = 6 times its checkpoint bytes (BF16
# widened to float32).
OVERHEAD = 6
# Of each tensor's elements, what a delta the plan scatters on every device changes: below the
# host's crossover (a BF16 element's 2 bytes / scatter.HOST_SCATTER_ELEMENT_BYTES, ~3 %).
SPARSE = 0.01


class Fused(torch.nn.Module):
    """q, k and v land in column blocks of one fused parameter (strided regions); ``norm`` is
    kept in float32 and widened from the checkpoint's BF16, as vLLM keeps some biases."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(32, 96, dtype=BF16, device=device), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(256, dtype=torch.float32, device=device), requires_grad=False)

    def load_weights(self, weights) -> None:
        for name, t in weights:
            if name == "norm":
                self.norm.data.copy_(t)
            else:
                i = "qkv".index(name)
                self.qkv.data[:, 32 * i : 32 * (i + 1)].copy_(t)


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(32, 32, generator=gen).to(BF16) for n in "qkv"}
    out["norm"] = torch.randn(256, generator=gen).to(BF16)
    return out


def changed(
    old: dict[str, torch.Tensor], fraction: float, seed: int, only: str | None = None
) -> dict[str, torch.Tensor]:
    """``old`` with about ``fraction`` of each tensor's elements changed (``only``: one tensor)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in old.items():
        t = t.clone()
        if only is None or name == only:
            mask = torch.rand(t.shape, generator=gen) < fraction
            t[mask] = (t[mask].float() + 1.0).to(BF16)
        out[name] = t
    return out


def engine(device: str, values: dict[str, torch.Tensor]) -> WeightMap:
    model = Fused(device)
    model.load_weights(values.items())
    return WeightMap.build(model, [(n, tuple(t.shape), t.dtype) for n, t in values.items()], values.__getitem__)


def served(wmap: WeightMap) -> dict[str, torch.Tensor]:
    return {n: wmap.held(n).cpu() if wmap.whole(n) is None else wmap.whole(n).cpu().clone() for n in wmap.names()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def stage_of(wmap: WeightMap, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], label: str):
    tensors = list(new.items())
    expected = {n: adler32_hex(t) for n, t in tensors}
    return take(wmap, label, tensors, backup=dict(old), expected_adler32=expected, checked=True, sparse=True), expected


def delta_in_slot(device: str, seed: int) -> tuple[dict, dict, WeightMap, StageSlot]:
    """An engine on checkpoint ``seed`` with a delta (seed + 1) it scatters staged in its slot as "v1"."""
    old = checkpoint(seed)
    new = changed(old, SPARSE, seed=seed + 1)
    wmap, slot = engine(device, old), StageSlot()
    slot.put(stage_of(wmap, old, new, "v1")[0])
    return old, new, wmap, slot


@pytest.mark.parametrize("device", DEVICES)
def test_a_sparse_delta_moves_only_its_changed_elements_and_is_proven(device: str) -> None:
    old = checkpoint(1)
    new = changed(old, SPARSE, seed=2)
    wmap, slot = engine(device, old), StageSlot()
    stage, expected = stage_of(wmap, old, new, "v1")
    assert set(stage.scattered()) == {"q", "k", "v", "norm"}
    assert same(served(wmap), old)  # staged, not served
    slot.put(stage)
    report = slot.swap_and_commit(wmap, "v1")
    assert report["verified"] == 4 and report["checksums"] == expected
    assert same(served(wmap), new)
    assert torch.equal(wmap.model.norm.cpu(), new["norm"].float())  # widened exactly
    dense = sum(scatter.dense_bytes(wmap, n) for n in new)
    assert 0 < report["changed_bytes"] and report["sparse_tensors"] == 4
    assert report["pause_bytes"] <= OVERHEAD * report["changed_bytes"] < dense
    assert report["device_staged_bytes"] == report["pause_bytes"]


@pytest.mark.parametrize("device", DEVICES)
def test_each_tensor_goes_the_way_that_moves_fewer_bytes(device: str, monkeypatch) -> None:
    old = checkpoint(3)
    new = changed(old, 1.0, seed=4, only="q")  # q changes everywhere, k, v and norm not at all
    wmap = engine(device, old)
    stage, _ = stage_of(wmap, old, new, "v1")
    assert set(stage.scattered()) == {"k", "v", "norm"}  # nothing to scatter costs nothing
    assert set(stage.plan.on_device) == ({"q"} if device != "cpu" else set())  # staged on the accelerator
    report = stage.plan.report()
    assert report["pause_bytes"] == scatter.dense_bytes(wmap, "q")
    assert report["changed_bytes"] == new["q"].nbytes
    # A budget too small for the scatter buffers: every tensor goes whole.
    monkeypatch.setenv(scatter.BUDGET_ENV, "0")
    few = changed(old, 0.02, seed=5)
    stage, _ = stage_of(wmap, old, few, "v2")
    assert all(s.offsets.numel() == 0 for s in stage.scatters())
    assert stage.plan.report()["device_staged_bytes"] == 0
    monkeypatch.setenv(scatter.BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match="ROLLOUTS_SCATTER_BUDGET_BYTES='lots'"):
        stage_of(wmap, old, few, "v3")


@pytest.mark.parametrize("device", DEVICES)
def test_another_ranks_expert_is_staged_but_nothing_of_it_is_kept_moved_or_proven_here(device: str) -> None:
    """Expert parallelism: the update names an expert another rank owns (*elsewhere* here). This
    rank takes the stage, keeps no roll-back copy of it, moves none of its bytes and proves the
    rest; a failed read-back still rolls back what it holds."""
    old = checkpoint(12)
    new = changed(old, 0.05, seed=13)
    wmap, slot = engine(device, old), StageSlot()
    wmap.entries["expert.5"] = Entry("expert.5", (64, 32), BF16, elsewhere=True)
    expert = torch.randn(64, 32).to(BF16)
    tensors = [*new.items(), ("expert.5", expert)]
    expected = {n: adler32_hex(t) for n, t in tensors}
    stage = take(wmap, "v1", tensors, expected_adler32=expected, checked=True, sparse=False)
    assert "expert.5" not in stage.backup and "expert.5" not in stage.plan.on_device
    assert stage.plan.report()["staged_bytes"] == sum(t.nbytes for t in new.values())
    slot.put(stage)
    report = slot.swap_and_commit(wmap, "v1")
    assert same(served(wmap), new)
    assert report["verified"] == 5 and set(report["checksums"]) == set(new)  # the owner proves the expert
    assert report["pause_bytes"] == sum(scatter.dense_bytes(wmap, n) for n in new)
    # A stage whose q differs from its checksum (not checked when taken): rolled back, the expert
    # not named.
    wrong = {**{n: adler32_hex(t) for n, t in old.items()}, "q": "00000000", "expert.5": expected["expert.5"]}
    slot.put(take(wmap, "v2", [*old.items(), ("expert.5", expert)], expected_adler32=wrong))
    assert slot.swap_and_commit(wmap, "v2")["read_back_failed"] == ["q"]
    assert same(served(wmap), new)


@pytest.mark.parametrize("device", DEVICES)
def test_a_full_goes_whole_staged_on_the_accelerator(device: str) -> None:
    old, new = checkpoint(10), checkpoint(11)
    wmap, slot = engine(device, old), StageSlot()
    tensors = list(new.items())
    expected = {n: adler32_hex(t) for n, t in tensors}
    slot.put(take(wmap, "full", tensors, expected_adler32=expected, checked=True))
    report = slot.swap_and_commit(wmap, "full")
    assert report["verified"] == 4 and report["sparse_tensors"] == 0 and same(served(wmap), new)
    assert report["pause_bytes"] == sum(scatter.dense_bytes(wmap, n) for n in new)
    assert report["device_staged_bytes"] == (sum(t.nbytes for t in new.values()) if device != "cpu" else 0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_read_back_after_a_scatter_restores_every_element(device: str) -> None:
    old, new, wmap, slot = delta_in_slot(device, seed=6)
    assert slot.stage is not None and slot.stage.scattered() == set(new)
    slot.swap(wmap, "v1")
    # A fault after the scatter: an element the delta did not change differs now.
    unchanged = (new["q"].view(torch.int16) == old["q"].view(torch.int16)).reshape(-1).nonzero()[0, 0]
    wmap.model.qkv.data[unchanged // 32, unchanged % 32] += 1
    assert slot.commit(wmap, "v1") == {"read_back_failed": ["q"], "rolled_back": True}
    assert same(served(wmap), old)


@pytest.mark.parametrize("device", DEVICES)
def test_another_ranks_failure_rolls_a_proven_scatter_back(device: str) -> None:
    old, new, wmap, slot = delta_in_slot(device, seed=8)
    assert slot.swap_and_commit(wmap, "v1", hold=True)["verified"] == 4
    assert same(served(wmap), new)
    assert slot.discard(wmap) == {"discarded": "v1", "rolled_back": True}  # another rank failed
    assert same(served(wmap), old)


@pytest.mark.parametrize("device", DEVICES)
def test_a_full_past_the_device_budget_crosses_from_pinned_memory_and_is_proven(device: str, monkeypatch) -> None:
    """Past the device budget a dense tensor of a CUDA engine waits in pinned host memory and
    the pause copies it asynchronously; past the pinned budget too, from the staged (pageable)
    tensor. A CPU engine pins nothing. Every way is proven and rolls back exactly."""
    old, new = checkpoint(12), checkpoint(13)
    monkeypatch.setenv(scatter.BUDGET_ENV, "0")
    tensors = list(new.items())
    expected = {n: adler32_hex(t) for n, t in tensors}
    for pinned_budget, pinned in (("", device == "cuda"), ("0", False)):
        monkeypatch.setenv(scatter.PINNED_BUDGET_ENV, pinned_budget)
        wmap, slot = engine(device, old), StageSlot()
        stage = take(wmap, "full", tensors, expected_adler32=expected, checked=True)
        assert set(stage.plan.pinned) == (set(new) if pinned else set())
        assert all(t.is_pinned() for t in stage.plan.pinned.values())
        assert [n for n, _ in stage.dense()] == ([] if pinned else list(new))
        slot.put(stage)
        report = slot.swap_and_commit(wmap, "full", hold=True)
        assert report["verified"] == 4 and same(served(wmap), new), pinned_budget
        assert report["device_staged_bytes"] == 0
        assert report["pinned_staged_bytes"] == (sum(t.nbytes for t in new.values()) if pinned else 0)
        assert slot.discard(wmap)["rolled_back"] and same(served(wmap), old)
    monkeypatch.setenv(scatter.PINNED_BUDGET_ENV, "some")
    with pytest.raises(ValueError, match="ROLLOUTS_PINNED_BUDGET_BYTES='some'"):
        take(engine(device, old), "full", tensors)


def test_fused_experts_are_planned_a_parameter_at_a_time_as_tensor_by_tensor(monkeypatch) -> None:
    # These experts' 24 elements are fewer than what one scattered element costs on the host:
    # a cost at which a few changed elements still scatter (the plan compares them either way).
    monkeypatch.setattr(scatter, "HOST_SCATTER_ELEMENT_BYTES", 6)
    old = expert_checkpoint(0)
    new = changed(old, 0.05, seed=9)
    new["experts.2.down_proj.weight"] = changed(old, 1.0, seed=10)["experts.2.down_proj.weight"]  # goes whole
    wmap, slot = loaded(Experts(), old), StageSlot()
    stage, expected = stage_of(wmap, old, new, "v1")
    assert stage.plan.batched and not stage.plan.sparse  # every tensor lands whole in one dense region
    reference = scatter.Plan()
    for name, t in new.items():
        scatter._plan_one(wmap, name, t, old[name], reference, scatter.DEFAULT_BUDGET, 0)
    assert stage.scattered() == reference.scattered() == set(new) - {"experts.2.down_proj.weight"}
    assert stage.plan.report() == reference.report()
    ours, theirs = scatter.by_param(stage.scatters(), True), scatter.by_param(reference.scatters(), True)
    assert ours.keys() == theirs.keys()
    for param, (offsets, values) in ours.items():
        order, ref_order = offsets.argsort(), theirs[param][0].argsort()
        assert torch.equal(offsets[order], theirs[param][0][ref_order])
        assert torch.equal(values[order].view(torch.int16), theirs[param][1][ref_order].view(torch.int16))
    # Swapped, proven and held, then discarded (another rank failed): exactly the old weights again.
    slot.put(stage)
    report = slot.swap_and_commit(wmap, "v1", hold=True)
    assert report["verified"] == len(new) and report["checksums"] == expected
    assert all(adler32_hex(wmap.held(n)) == expected[n] for n in new)
    slot.discard(wmap)
    assert all(torch.equal(wmap.held(n).view(torch.int16), old[n].view(torch.int16)) for n in old)


def host_choice(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], wmap: WeightMap) -> set[str]:
    """The tensors the host's cost model scatters, from the counts of their changed elements:
    scattering them costs less than a copy of the whole tensor."""
    out = set()
    for name in new:
        count = int((new[name].view(torch.int16) != old[name].view(torch.int16)).sum())
        if count * scatter.HOST_SCATTER_ELEMENT_BYTES < scatter.dense_bytes(wmap, name):
            out.add(name)
    return out


def test_on_the_host_each_tensor_goes_the_faster_way_proven_and_rolled_back_exactly() -> None:
    """A delta changing q and the widened norm densely (20 %: whole is faster on the host), k
    sparsely (1 %: scattered), v not at all: each planned by the host's cost model, the bytes
    served after the swap are the new ones exactly, and every roll-back (a failed read-back in a
    tensor of either form, another rank's failure) puts the old ones back exactly."""
    old = checkpoint(20)
    new = {**changed(old, 0.2, seed=21), "k": changed(old, SPARSE, seed=22)["k"], "v": old["v"].clone()}
    wmap = engine("cpu", old)
    stage, expected = stage_of(wmap, old, new, "v1")
    assert stage.scattered() == host_choice(old, new, wmap) == {"k", "v"}  # the premise: both forms
    report = stage.plan.report()
    whole = scatter.dense_bytes(wmap, "q") + scatter.dense_bytes(wmap, "norm")
    assert report["pause_bytes"] == whole + sum(s.nbytes() for s in stage.scatters())
    assert not stage.plan.on_device and not stage.plan.pinned  # copied from the stage's own tensors
    slot = StageSlot()
    slot.put(stage)
    assert slot.swap_and_commit(wmap, "v1", hold=True)["checksums"] == expected
    assert same(served(wmap), new) and torch.equal(wmap.model.norm, new["norm"].float())
    assert slot.discard(wmap)["rolled_back"] and same(served(wmap), old)  # another rank failed

    for name in ("q", "k"):  # an element the delta left as it was, altered after the write
        slot.put(stage_of(wmap, old, new, f"bad-{name}")[0])
        slot.swap(wmap, f"bad-{name}")
        column = 32 * "qkv".index(name)
        unchanged = (new[name].view(torch.int16) == old[name].view(torch.int16)).reshape(-1).nonzero()[0, 0]
        wmap.model.qkv.data[unchanged // 32, column + unchanged % 32] += 1
        assert slot.commit(wmap, f"bad-{name}") == {"read_back_failed": [name], "rolled_back": True}
        assert same(served(wmap), old)


def test_the_cost_of_a_scattered_element_is_time_on_the_host_and_bytes_on_an_accelerator() -> None:
    host, accelerator = torch.empty(8, dtype=BF16), torch.empty(8, dtype=BF16, device="meta")
    assert scatter.element_cost(host) == scatter.HOST_SCATTER_ELEMENT_BYTES
    assert scatter.element_cost(accelerator) == 2 + 4  # a BF16 value and an int32 offset cross
    assert scatter._offset_dtype(host) == torch.int64  # taken by torch's indexed write as it is


def test_each_changed_position_is_placed_in_its_segment() -> None:
    positions = torch.tensor([0, 2, 3, 6, 7, 8])
    assert scatter._members(positions, [5, 5]).tolist() == [0, 0, 0, 1, 1, 1]
    assert scatter._members(positions, [1, 3, 6]).tolist() == [0, 1, 1, 2, 2, 2]


def test_flat_cat_is_each_tensor_flattened_one_after_the_other() -> None:
    gen = torch.Generator().manual_seed(5)
    same = [torch.randn(3, 4, generator=gen) for _ in range(3)]  # a fused parameter's experts
    mixed = [torch.randn(3, 4, generator=gen), torch.randn(4, 3, generator=gen).t(), torch.randn(5, generator=gen)]
    for tensors in (same, mixed, [torch.tensor(1.0), torch.randn(2, generator=gen)]):
        assert torch.equal(flat_cat(tensors), torch.cat([t.reshape(-1) for t in tensors]))
