"""Addresses across real hosts (network namespaces, tests/multihost/hosts.py), without vLLM:

- the engine guard (replica/engine/guard.py) behind uvicorn as an engine runs it (bound to
  0.0.0.0, ``FORWARDED_ALLOW_IPS`` as ``EngineProcess`` pins it): from another host the control
  routes are 403 ``permission_denied`` even with the secret and a forged ``X-Forwarded-For``,
  and the inference routes answer; from the engine's own host (loopback, or its own address) the
  control routes answer;
- the peer group (replica/engine/peer_group.py): a gloo broadcast from one host to another forms
  when each member's device binds its node address (``ROLLOUTS_NODE_ADDRESS``); without it the
  device falls back to an address the other host cannot reach and the group does not form (the
  premise of the change).

Traffic goes only to the hosts' own addresses and their loopback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.settings import ENGINE_SECRET_HEADER
from replica.agent.engine_process import EngineProcess
from replica.launch import NODE_ADDRESS_ENV
from tests.multihost.hosts import Cluster, Host

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[2]
PORT = 8100  # each host has its own network namespace: nothing else binds there
SECRET = "secret-for-the-multihost-guard-test"

# An engine stand-in: EngineGuard over an app that answers 200 {"reached": path}, served by
# uvicorn on 0.0.0.0 like vLLM's server (proxy headers on, trusted hosts from the environment).
GUARDED_SERVER = f"""
import json, sys, uvicorn
from replica.engine.guard import EngineGuard

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({{"type": "lifespan.startup.complete"}})
        await send({{"type": "lifespan.shutdown.complete"}})
        return
    body = json.dumps({{"reached": scope["path"], "client": scope["client"][0]}}).encode()
    await send({{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}})
    await send({{"type": "http.response.body", "body": body}})

uvicorn.run(EngineGuard(app, {SECRET!r}), host="0.0.0.0", port={PORT}, log_level="warning")
"""

# status and JSON body of METHOD URL with the secret header and optional extra headers (argv[3]: JSON)
CALL = f"""
import json, sys, time, urllib.request, urllib.error
method, url, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({{}}))
request = urllib.request.Request(url, method=method, data=b"{{}}" if method == "POST" else None,
                                 headers={{{ENGINE_SECRET_HEADER!r}: {SECRET!r}, **extra}})
for attempt in range(100):
    try:
        with opener.open(request, timeout=10) as r:
            print(json.dumps([r.status, json.loads(r.read())])); break
    except urllib.error.HTTPError as e:
        print(json.dumps([e.code, json.loads(e.read())])); break
    except urllib.error.URLError:
        time.sleep(0.2)  # the server is still starting
else:
    print(json.dumps([0, {{}}]))
"""

# One member of a 2-member gloo group meeting at argv[1]:argv[2]; rank argv[3]; rank 0 sends.
MEMBER = """
import sys, torch
from replica.engine.peer_group import PeerGroup
host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
group = PeerGroup.create(host, port, rank, 2, "gloo", timeout_s=float(sys.argv[4]))
sent = torch.arange(1000, dtype=torch.float32)
tensor = sent.clone() if rank == 0 else torch.zeros(1000)
group.broadcast(tensor, 0)
assert torch.equal(tensor, sent)
group.close()
print("received" if rank else "sent")
"""


def call(source: Host, method: str, url: str, extra: dict[str, str] | None = None) -> tuple[int, dict]:
    proc = source.run(
        [PYTHON, "-c", CALL, method, url, json.dumps(extra or {})],
        timeout=60,
        env={"PYTHONPATH": str(REPO)},
        check=True,
    )
    status, body = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status, f"{source.name} could not reach {url}"
    return status, body


@pytest.fixture(scope="module")
def guarded_engine(cluster: Cluster) -> Host:
    engine_host = cluster[0]
    env = EngineProcess(
        "model", work_dir=engine_host.home / "engine", host="0.0.0.0", node_address=engine_host.address
    ).environment()
    engine_host.spawn(
        [PYTHON, "-c", GUARDED_SERVER], env={"FORWARDED_ALLOW_IPS": env["FORWARDED_ALLOW_IPS"], "PYTHONPATH": str(REPO)}
    )
    return engine_host


def test_engine_control_refuses_another_host(cluster: Cluster, guarded_engine: Host) -> None:
    other = cluster[1]
    base = f"http://{guarded_engine.address}:{PORT}"
    for method, path in (
        ("POST", "/rollouts/pause"),
        ("POST", "/rollouts/collective_rpc"),
        ("POST", "/rollouts/swap_in_pause"),
    ):
        for extra in ({}, {"X-Forwarded-For": "127.0.0.1"}):
            status, body = call(other, method, base + path, extra)
            assert status == 403, (path, extra, body)
            assert body["error"]["type"] == "permission_denied", body
            assert other.address in body["error"]["message"] and "own host" in body["error"]["message"], body
    # Inference answers the other host (the gateway's case).
    status, body = call(other, "GET", base + "/v1/models")
    assert (status, body["reached"], body["client"]) == (200, "/v1/models", other.address)


def test_engine_control_answers_its_own_host(guarded_engine: Host) -> None:
    for url in (f"http://127.0.0.1:{PORT}/rollouts/pause", f"http://{guarded_engine.address}:{PORT}/rollouts/pause"):
        status, body = call(guarded_engine, "POST", url)
        assert (status, body["reached"]) == (200, "/rollouts/pause"), (url, body)


def _broadcast(
    sender: Host, receiver: Host, port: int, env_of: dict[str, dict[str, str]], timeout_s: float
) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    common = {"PYTHONPATH": str(REPO)}
    log = sender.logs / f"member-{port}.log"
    send = sender.spawn(
        [PYTHON, "-c", MEMBER, sender.address, str(port), "0", str(timeout_s)],
        env={**common, **env_of[sender.name]},
        log_path=log,
    )
    received = receiver.run(
        [PYTHON, "-c", MEMBER, sender.address, str(port), "1", str(timeout_s)],
        env={**common, **env_of[receiver.name]},
        timeout=timeout_s + 120,
    )
    send.wait(timeout=timeout_s + 120)
    return subprocess.CompletedProcess(send.args, send.returncode, log.read_text(), ""), received


def test_a_broadcast_crosses_hosts_when_each_device_binds_its_node_address(cluster: Cluster) -> None:
    sender, receiver = cluster[1], cluster[2]
    bound = {h.name: {NODE_ADDRESS_ENV: h.address} for h in (sender, receiver)}
    sent, received = _broadcast(sender, receiver, 8201, bound, timeout_s=60)
    assert sent.returncode == 0 and sent.stdout.strip().endswith("sent"), sent.stdout[-2000:]
    assert received.returncode == 0 and received.stdout.strip() == "received", received.stderr[-2000:]


def test_without_the_node_address_the_group_does_not_form_across_hosts(cluster: Cluster) -> None:
    """The premise: torch's default device is the hostname's address, which inside a host's
    namespace is not one the other host reaches (loopback here, or the root's address)."""
    sender, receiver = cluster[1], cluster[2]
    port, timeout_s = 8202, 8
    env = {"PYTHONPATH": str(REPO), NODE_ADDRESS_ENV: ""}
    logs = [host.logs / f"member-{port}-{rank}.log" for rank, host in enumerate((sender, receiver))]
    members = [
        host.spawn(
            [PYTHON, "-c", MEMBER, sender.address, str(port), str(rank), str(timeout_s)], env=env, log_path=logs[rank]
        )
        for rank, host in enumerate((sender, receiver))
    ]
    try:
        # The member whose turn it is to connect fails first (gloo orders a pair by address and
        # port, so either may be), refused at the address the other published.
        deadline = time.monotonic() + timeout_s + 120
        while all(member.poll() is None for member in members) and time.monotonic() < deadline:
            time.sleep(0.1)
        first = next((rank for rank, member in enumerate(members) if member.poll() is not None), None)
        assert first is not None, "neither member gave up"
        assert members[first].returncode != 0
    finally:
        for member in members:  # the other one may wait out gloo's longer accept timeout
            if member.poll() is None:
                os.killpg(member.pid, signal.SIGKILL)
                member.wait()
    log = logs[first].read_text()
    assert "RuntimeError" in log and "remote=[127.0.0.1]" in log, log[-3000:]
