"""An update's hotLoad section against the deployment's (control/admission.py `same_hot_load`): the
guide's fields must match; a large-deployment setting left at its default keeps the deployment's,
one set to another value is a change (refused)."""

from __future__ import annotations

from contracts.records import HotLoadConfig
from control.admission import same_hot_load

SPEC = HotLoadConfig(bucket="b", path_prefix="p", peer_fan_out=1, max_concurrent_swaps=8)


def test_the_guides_fields_alone_match_a_tuned_section():
    assert same_hot_load(HotLoadConfig(bucket="b", path_prefix="p"), SPEC)
    assert same_hot_load(SPEC.model_copy(), SPEC)


def test_a_changed_field_is_a_change():
    assert not same_hot_load(HotLoadConfig(bucket="b", path_prefix="q"), SPEC)
    assert not same_hot_load(HotLoadConfig(bucket="b", path_prefix="p", peer_fan_out=2), SPEC)
    assert not same_hot_load(HotLoadConfig(bucket="b", path_prefix="p", replicas_per_group=50), SPEC)
