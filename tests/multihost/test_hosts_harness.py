"""The multi-host harness itself (tests/multihost/hosts.py): three hosts reach each other over the
bridge; /dev/shm is private per host; a link down partitions a host and a link up heals it;
kill_all leaves nothing running; teardown and the sweep of a killed run leave none of their names.

Traffic goes only to the hosts' own addresses."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from common.processes import pid_alive
from tests.multihost.hosts import Cluster, Host, choose_network
from tests.multihost.iproute import link_names, netns_names
from tests.multihost.runs import IFNAME_MAX, MAX_HOSTS, MAX_SEQ, RunTag, marker_path, parse_tag

PYTHON = sys.executable  # the project's venv python: the hosts share the machine's file system
PORT = 8000  # each host has its own network namespace: nothing else binds there
REPO = Path(__file__).resolve().parents[2]
# Exits 0 printing "ok" when a TCP connect to ADDR:PORT succeeds within TIMEOUT s, else 1 with the error.
CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__, exc); sys.exit(1)\n"
    "print('ok')\n"
)
# Fetches a URL with no proxy (an http_proxy in the environment must not carry the request elsewhere).
FETCH = (
    "import sys, urllib.request\n"
    "opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
    "print(opener.open(sys.argv[1], timeout=10).read().decode())\n"
)


def harness_names() -> set[str]:
    return {name for name in [*netns_names(), *link_names()] if parse_tag(name)}


def connects(source: Host, target: Host, timeout: float = 2.0) -> subprocess.CompletedProcess:
    return source.run([PYTHON, "-c", CONNECT, target.address, str(PORT), str(timeout)], timeout=timeout + 30)


def wait_connects(source: Host, target: Host, within: float = 30.0) -> None:
    """Until ``source`` connects to ``target``'s server; fails naming the last error after ``within`` s."""
    deadline = time.monotonic() + within
    while (probe := connects(source, target)).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail(
                f"{source.name} cannot connect to {target.name} {target.address}:{PORT}: {probe.stdout.strip()}"
            )
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An HTTP server on every host, bound to its address, serving a file naming the host."""
    served = {}
    for host in cluster:
        root = tmp_path_factory.mktemp(f"www-{host.name}")
        (root / "who").write_text(host.name)
        host.spawn([PYTHON, "-m", "http.server", "--bind", host.address, "--directory", str(root), str(PORT)])
        served[host.name] = f"http://{host.address}:{PORT}/who"
    for host in cluster:
        wait_connects(cluster[0] if host is not cluster[0] else cluster[1], host)
    return served


def test_hosts_have_their_own_addresses_and_homes(cluster: Cluster) -> None:
    assert len(cluster) == 3
    assert len({h.address for h in cluster}) == 3 and len({h.netns for h in cluster}) == 3
    for host in cluster:
        shown = host.run(["ip", "-o", "-4", "addr", "show", "dev", "eth0"], check=True).stdout
        assert f"inet {host.address}/24" in shown
        env = host.run([PYTHON, "-c", "import os; print(os.environ['HOME'], os.getcwd())"], check=True).stdout.split()
        assert env == [str(host.home), str(host.home)]
    assert len({h.home for h in cluster}) == 3


def test_every_host_reaches_every_other(cluster: Cluster, servers: dict[str, str]) -> None:
    for source in cluster:
        for target in cluster:
            if source is not target:
                got = source.run([PYTHON, "-c", FETCH, servers[target.name]], timeout=30, check=True).stdout
                assert got.strip() == target.name, (source.name, target.name)
    # The root namespace is on the bridge too: the test process reaches every host directly.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for target in cluster:
        assert opener.open(servers[target.name], timeout=10).read().decode() == target.name


def test_names_fit_interface_limits_and_foreign_names_are_not_the_harness_s() -> None:
    longest = RunTag(pid=0x3FFFFF, seq=MAX_SEQ)  # pid_max is at most 2**22
    assert all(len(name) <= IFNAME_MAX for name in (longest.bridge, longest.veth(MAX_HOSTS), longest.netns(MAX_HOSTS)))
    assert parse_tag(longest.veth(MAX_HOSTS)) == longest and longest.owns(longest.bridge)
    for foreign in ("eth0", "lo", "docker0", "rmh", "rmh-test", "rmhzzs0br", "rmh1s0brx", "xrmh1s0br", "rmh1s0v"):
        assert parse_tag(foreign) is None, foreign
    assert not RunTag(1, 0).owns(RunTag(1, 1).bridge) and not RunTag(1, 0).owns(RunTag(2, 0).bridge)


def test_the_bridge_network_overlaps_nothing_in_use() -> None:
    used = [ipaddress.IPv4Network("10.200.0.0/16"), ipaddress.IPv4Network("10.201.0.0/24")]
    assert choose_network(used) == ipaddress.IPv4Network("10.202.0.0/24")
    with pytest.raises(RuntimeError, match="no free 10.X.0.0/24"):
        choose_network([ipaddress.IPv4Network("10.0.0.0/8")])


def test_dev_shm_is_private_per_host(cluster: Cluster, tmp_path: Path) -> None:
    name = f"harness-probe-{os.getpid()}-{tmp_path.name}"
    first, second, third = cluster
    first.run(["sh", "-c", f"echo {first.name} > /dev/shm/{name}"], check=True)
    assert first.run(["cat", f"/dev/shm/{name}"], check=True).stdout.strip() == first.name  # premise: written
    assert (first.shm / name).read_text().strip() == first.name  # and seen through the holder from the root
    for other in (second, third):
        assert other.run(["test", "-e", f"/dev/shm/{name}"]).returncode == 1, other.name
    assert not (Path("/dev/shm") / name).exists()
    size = first.run(
        [PYTHON, "-c", "import os; s = os.statvfs('/dev/shm'); print(s.f_blocks * s.f_frsize)"], check=True
    ).stdout
    assert int(size) == first.shm_bytes
    # A process spawned in the host sees the same /dev/shm as one run there.
    out = first.logs / "shm-reader.log"
    first.spawn(["cat", f"/dev/shm/{name}"], log_path=out).wait(timeout=30)
    assert out.read_text().strip() == first.name


def test_link_down_partitions_a_host_and_link_up_heals_it(cluster: Cluster, servers: dict[str, str]) -> None:
    first, second, _ = cluster
    assert connects(second, first).returncode == 0  # premise: reachable
    first.link_down()
    try:
        cut = connects(second, first, timeout=2.0)
        assert cut.returncode == 1, cut.stdout
        assert "timed out" in cut.stdout or "No route to host" in cut.stdout, cut.stdout
    finally:
        first.link_up()
    wait_connects(second, first)


def test_kill_all_leaves_no_process_and_boot_starts_an_empty_host(make_cluster) -> None:
    with make_cluster(1, shm_bytes=64 * 1024**2) as one:
        host = one[0]
        host.run(["sh", "-c", "echo x > /dev/shm/before-death"], check=True)
        tree = host.spawn(["sh", "-c", "sleep 1000 & sleep 1000 & wait"])
        sleeper = host.spawn(["sleep", "1000"])
        deadline = time.monotonic() + 30
        while len(host.pids()) < 5:  # holder, sh, its two sleeps, sleeper
            assert time.monotonic() < deadline, f"expected 5 processes in {host.netns}, saw {host.pids()}"
            time.sleep(0.01)
        before = host.pids()
        assert {host.holder_pid, tree.pid, sleeper.pid} <= set(before)

        killed = host.kill_all()
        assert set(before) <= set(killed)
        assert host.pids() == []
        assert not host.alive and tree.returncode == -signal.SIGKILL and sleeper.returncode == -signal.SIGKILL
        assert not any(pid_alive(pid) for pid in before)

        host.boot()
        assert host.alive and host.pids() == [host.holder_pid]
        assert host.run(["ls", "-A", "/dev/shm"], check=True).stdout == ""


def test_teardown_leaves_none_of_its_names_even_on_an_error(make_cluster) -> None:
    made = make_cluster(2, shm_bytes=16 * 1024**2)
    with pytest.raises(RuntimeError, match="the test body failed"):
        with made:
            names = made.names()
            holders = [h.holder_pid for h in made]
            spawned = made[1].spawn(["sleep", "1000"])
            assert set(names) <= harness_names()  # premise: they existed
            assert marker_path(made.tag).exists()
            tag = made.tag
            raise RuntimeError("the test body failed")
    assert not set(names) & (set(netns_names()) | set(link_names()))
    assert not any(pid_alive(pid) for pid in [*holders, spawned.pid])
    assert not marker_path(tag).exists()


def test_a_killed_run_is_swept_by_the_next_one(cluster: Cluster, make_cluster, tmp_path: Path) -> None:
    script = (
        "import json, sys, time\n"
        "from tests.multihost.hosts import Cluster\n"
        f"c = Cluster(2, shm_bytes=16 * 1024**2, base_dir={str(tmp_path)!r}).__enter__()\n"
        "print(json.dumps({'names': c.names(), 'holders': [h.holder_pid for h in c]}), flush=True)\n"
        "time.sleep(1000)\n"
    )
    child = subprocess.Popen([PYTHON, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        made = json.loads(child.stdout.readline())
    finally:
        child.kill()
        child.wait(timeout=30)
    assert set(made["names"]) <= harness_names()  # premise: the killed run left its namespaces and links
    assert all(pid_alive(pid) for pid in made["holders"])  # and its hosts' processes
    live = set(cluster.names())

    with make_cluster(1, shm_bytes=16 * 1024**2):
        pass

    assert not set(made["names"]) & harness_names()
    assert not any(pid_alive(pid) for pid in made["holders"])
    assert not marker_path(parse_tag(made["names"][0])).exists()
    assert live <= harness_names()  # this process's live cluster was left alone
