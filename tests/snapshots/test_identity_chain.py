"""Identity rules and chain validation."""

from __future__ import annotations

import pytest

from snapshots import ChainError, ChainLink, IdentityError, resolve_chain, validate_chain, validate_identity


@pytest.mark.parametrize("good", ["step-000420", "weight_v000001", "a", "x" * 128, "v1.2"])
def test_valid_identities(good: str) -> None:
    assert validate_identity(good) == good


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("a/b", "single path segment"),
        ("..", "'..'"),
        ("a..b", "'..'"),
        ("x" * 129, "1-128 characters"),
        ("", "1-128 characters"),
        ("initial", "reserved"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
    ],
)
def test_invalid_identities_name_the_field(bad: str, why: str) -> None:
    with pytest.raises(IdentityError) as err:
        validate_identity(bad)
    assert "identity" in str(err.value) and why in str(err.value)
    with pytest.raises(IdentityError, match="previousSnapshotIdentity"):
        validate_identity(bad, field="previousSnapshotIdentity")


def _chain(deltas: int) -> list[ChainLink]:
    links = [ChainLink("base", "SNAPSHOT_TYPE_FULL")]
    for i in range(1, deltas + 1):
        links.append(ChainLink(f"d{i}", "SNAPSHOT_TYPE_INCREMENTAL", links[-1].identity))
    return links


def test_chain_of_63_deltas_is_valid() -> None:
    links = validate_chain(_chain(63))
    assert [link.type for link in links[:2]] == ["full", "delta"]


def test_chain_of_64_deltas_is_refused_naming_the_link() -> None:
    with pytest.raises(ChainError, match=r"chain link 64 \('d64'\).*64 deltas.*63"):
        validate_chain(_chain(64))


def test_delta_whose_base_is_not_the_previous_link() -> None:
    links = _chain(3)
    links[2] = ChainLink("d2", "delta", "base")
    with pytest.raises(ChainError, match=r"chain link 2 \('d2'\).*computed against 'base'.*previous link is 'd1'"):
        validate_chain(links)


def test_chain_must_start_full_and_have_one_full() -> None:
    with pytest.raises(ChainError, match="chain link 0.*must start with a full"):
        validate_chain([ChainLink("d1", "delta", "x")])
    with pytest.raises(ChainError, match="chain link 1.*only the first link may be full"):
        validate_chain([ChainLink("a", "full"), ChainLink("b", "full")])
    with pytest.raises(ChainError, match="empty chain"):
        validate_chain([])


def test_chain_link_identity_rules_and_initial_base() -> None:
    validate_chain([ChainLink("initial", "full"), ChainLink("d1", "delta", "initial")])
    with pytest.raises(ChainError, match=r"chain link 1 \('a/b'\).*single path segment"):
        validate_chain([ChainLink("base", "full"), ChainLink("a/b", "delta", "base")])


def test_resolve_chain_walks_back_and_names_missing_links() -> None:
    known = {link.identity: link for link in _chain(5)}
    assert [link.identity for link in resolve_chain("d3", known)] == ["base", "d1", "d2", "d3"]
    del known["d2"]
    with pytest.raises(ChainError, match=r"'d2' \(the base of 'd3'\): no such snapshot"):
        resolve_chain("d5", known)
    loop = {"a": ChainLink("a", "delta", "b"), "b": ChainLink("b", "delta", "a")}
    with pytest.raises(ChainError, match="loops"):
        resolve_chain("a", loop)
    long = {link.identity: link for link in _chain(64)}
    with pytest.raises(ChainError, match="more than 63 deltas"):
        resolve_chain("d64", long)
