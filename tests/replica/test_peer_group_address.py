"""The peer broadcast's gloo device binds the node address it is given (replica/engine/peer_group.py),
not whatever this machine's hostname resolves to: two members in this process (threads), no
engine, loopback addresses only; and the rendezvous store an agent hosts answers at any of its host's
addresses.

Premise: the device's address is visible as the listening socket gloo opens for its pairs, so a
group formed with a loopback address other than 127.0.0.1 (which the hostname may resolve to)
listens there and its members connect there; without the address, it does not.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import psutil
import pytest
import torch
from torch.distributed import TCPStore

from common.processes import free_port
from replica.engine.peer_group import PeerGroup
from replica.launch import NODE_ADDRESS_ENV


def _tcp() -> set[tuple[str, str | None, str]]:
    return {(c.laddr.ip, c.raddr.ip if c.raddr else None, c.status) for c in psutil.Process().net_connections("tcp")}


def _form_and_broadcast(device_host: str | None) -> tuple[torch.Tensor, set[tuple[str, str | None, str]]]:
    """Two members meet at 127.0.0.1's store; rank 0 broadcasts a tensor. Returns what rank 1
    received and this process's TCP sockets while the group lived."""
    port = free_port()
    sent = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    def member(rank: int) -> tuple[PeerGroup, torch.Tensor]:
        group = PeerGroup.create("127.0.0.1", port, rank, 2, "gloo", timeout_s=60, device_host=device_host)
        tensor = sent.clone() if rank == 0 else torch.zeros_like(sent)
        group.broadcast(tensor, 0)
        return group, tensor

    with ThreadPoolExecutor(2) as pool:
        (g0, _), (g1, got) = pool.map(member, [0, 1])
    try:
        sockets = _tcp()
    finally:
        g0.close()
        g1.close()
    assert torch.equal(got, sent)
    return got, sockets


def _gloo_addresses(sockets: set[tuple[str, str | None, str]]) -> set[str]:
    """Addresses gloo listens on (the store listens on the wildcard, not on one address)."""
    return {laddr for laddr, _, status in sockets if status == "LISTEN" and laddr.startswith("127.")}


def test_a_group_with_its_device_on_127_0_0_1_broadcasts() -> None:
    _, sockets = _form_and_broadcast("127.0.0.1")
    assert "127.0.0.1" in _gloo_addresses(sockets)


@pytest.mark.parametrize("via", ["argument", "environment"])
def test_the_device_binds_the_node_address_not_the_hostnames(via: str, monkeypatch: pytest.MonkeyPatch) -> None:
    address = "127.0.0.2" if via == "argument" else "127.0.0.3"
    before = _gloo_addresses(_tcp())
    assert address not in before
    if via == "environment":
        monkeypatch.setenv(NODE_ADDRESS_ENV, address)
    _, sockets = _form_and_broadcast(address if via == "argument" else None)
    assert _gloo_addresses(sockets) - before == {address}, sockets
    # The pairs connected to that address.
    assert any(raddr == address and status == "ESTABLISHED" for _, raddr, status in sockets), sockets


def test_without_a_node_address_the_default_device_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)
    _, sockets = _form_and_broadcast(None)
    assert not {"127.0.0.2", "127.0.0.3"} & _gloo_addresses(sockets)


def test_a_hosted_rendezvous_store_answers_at_any_address_of_its_host() -> None:
    """The agent hosts the store at its offer's host and port (replica/agent/peers.py); receivers
    may arrive at another of the host's addresses (here 127.0.0.2 for a store named 127.0.0.1)."""
    port = free_port()
    master = TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = TCPStore("127.0.0.2", port, 2, is_master=False, timeout=timedelta(seconds=30))
    client.set("k", "from 127.0.0.2")
    assert master.get("k") == b"from 127.0.0.2"
