"""Every socket the embedded stack opens binds the configured host: after the stack is up and the
shared Dynamo deployment has taken a hot-load, the listening TCP sockets and bound UDP sockets of
every process this test session started (the stack's services, its Temporal and SeaweedFS, the
node agents, replica agents, Dynamo's frontend and workers, and vLLM's engine processes inside
them) are on ``stack.host`` (127.0.0.1) and nowhere else: not 0.0.0.0, not ::, not the machine's
own addresses. The failure names each process, its command line and the address. Dynamo's
processes bind no ZMQ publisher of their own (Dynamo's direct mode binds each on tcp://0.0.0.0):
they publish and subscribe through the stack's relay (gateway/dynamo_events.py), and the last
test reads the workers' events there."""

from __future__ import annotations

import ipaddress
import os
import time

import httpx
import psutil
import pytest
import zmq

from tests.helpers.gateway import GatewayDeployment, serve_full

pytestmark = pytest.mark.stack


def _sockets_of_this_sessions_processes() -> list[tuple[psutil.Process, str, int, str]]:
    out = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            listening = c.status == psutil.CONN_LISTEN or (c.type == 2 and c.status == psutil.CONN_NONE)  # 2: UDP
            if listening and c.laddr:
                out.append((proc, c.laddr.ip, c.laddr.port, "udp" if c.type == 2 else "tcp"))
    return out


DYNAMO = ("dynamo.frontend", "replica.engine.dynamo_worker")


def _off_host(gw: GatewayDeployment, dynamo: bool) -> list[str]:
    host = ipaddress.ip_address(gw.settings.host)
    found = _sockets_of_this_sessions_processes()
    assert found, "no listening socket found among this session's processes"
    wrong = []
    for proc, ip, port, kind in found:
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if any(m in cmd for m in DYNAMO) != dynamo:
            continue
        if ipaddress.ip_address(ip.split("%")[0]) != host:
            wrong.append(f"{kind} {ip}:{port} pid {proc.pid} ({cmd[:160]})")
    return sorted(wrong)


@pytest.fixture(scope="module")
def hot_loaded(gw: GatewayDeployment) -> GatewayDeployment:
    serve_full(gw, gw.base_model, "sockets")  # a hot-load ran: peers, stages and swaps opened theirs
    return gw


def test_every_socket_of_our_processes_binds_the_configured_host(hot_loaded: GatewayDeployment):
    """Temporal, SeaweedFS, the API, control worker, gateway, node and replica agents, vLLM."""
    wrong = _off_host(hot_loaded, dynamo=False)
    assert not wrong, f"sockets not on {hot_loaded.settings.host}:\n" + "\n".join(wrong)


def test_every_socket_of_dynamos_processes_binds_the_configured_host(hot_loaded: GatewayDeployment):
    wrong = _off_host(hot_loaded, dynamo=True)
    assert not wrong, f"sockets not on {hot_loaded.settings.host}:\n" + "\n".join(wrong)


def test_dynamos_events_pass_through_the_stacks_relay(hot_loaded: GatewayDeployment):
    """A subscriber of the relay's outbound (XPUB) socket receives the events Dynamo's processes
    publish while a deployment serves: the relay is where they go, not merely a socket that binds."""
    settings = hot_loaded.settings
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{settings.host}:{settings.ports['dynamo_events_out']}")
        topics: set[bytes] = set()
        deadline = time.monotonic() + 120
        while not topics and time.monotonic() < deadline:
            r = httpx.post(
                f"{hot_loaded.url}/v1/completions",
                headers=hot_loaded.headers,
                timeout=120,
                json={"model": hot_loaded.model, "prompt": [5, 6, 7], "max_tokens": 8},
            )
            assert r.status_code == 200, r.text
            while sub.poll(2000):
                topics.add(sub.recv_multipart()[0][:80])
        assert topics, "no event reached the relay's subscribers while the deployment served"
    finally:
        sub.close(linger=0)
