"""The test bed itself (tools/cluster.py): hosts, addresses, shaping, commands, and the teardown.

Skipped, with the reason, where network namespaces cannot be made. Throughput is not asserted
(times are not, in this suite); ``python tools/cluster.py measure`` reports it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools import cluster  # noqa: E402
from tools.cluster import Cluster, parse_rate, unavailable_reason  # noqa: E402

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"cannot make network namespaces: {REASON}")


def _ours(c: Cluster) -> list[str]:
    return [ns for ns in cluster._netns_list() if ns.startswith(c.run_id)]


def test_parse_rate():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("2.5Gbit") == 2_500_000_000
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("125mbps") == 10**9  # tc's "bps" is bytes per second
    assert parse_rate(5e8) == 500_000_000
    for bad in ("fast", "-1gbit", "0", 0):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_bad_host_names_are_refused():
    for hosts in (["a", "a"], ["Node0"], ["0a"], []):
        with pytest.raises(ValueError):
            Cluster(hosts)


@needs_netns
def test_hosts_addresses_links_and_teardown():
    with Cluster(["alpha", "beta", "gamma"], rate="200mbit") as c:
        assert sorted(_ours(c)) == sorted([c.run_id, *(h.netns for h in c.hosts)])
        script = (
            "hostname; cat /etc/hosts; ip -o -4 addr show; ip -o link show lo; "
            "tc qdisc show dev eth0; echo $GLOO_SOCKET_IFNAME $FDDP_HOST $FDDP_MASTER"
        )
        results = c.run_all([["sh", "-c", script]] * 3, timeout=30)
        for h, r in zip(c.hosts, results):
            assert r.returncode == 0, r.output
            lines = r.output.splitlines()
            assert lines[0] == h.name  # its own hostname
            assert f"{c.hosts[2].addr} gamma" in r.output  # knows the others by name
            assert f"inet {h.addr}/24" in r.output and "127.0.0.1/8" in r.output
            assert "state UNKNOWN" in r.output or "LOWER_UP" in r.output  # loopback is up
            assert "tbf" in r.output and "rate 200Mbit" in r.output  # what the host sends
            assert lines[-1] == f"eth0 {h.name} {c.hosts[0].addr}"
            # A host has its loopback and its own address, nothing of the caller's namespace.
            assert re.findall(r"inet (\S+)/", r.output) == ["127.0.0.1", h.addr], r.output
        # The switch's end of each link is shaped too (what the host receives).
        shown = subprocess.run(["tc", "-n", c.switch_netns, "qdisc", "show"], capture_output=True, text=True).stdout
        assert shown.count("rate 200Mbit") == 3, shown
        # Only in the namespaces: the caller's namespace has no interface or address of the test bed.
        here = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        assert all(h.addr not in here for h in c.hosts)
    assert _ours(c) == []
    assert not any((cluster.NETNS_ETC / h.netns).exists() for h in c.hosts)


@needs_netns
def test_two_test_beds_side_by_side_do_not_collide():
    with Cluster(2, rate=None) as a, Cluster(2, rate=None) as b:
        assert a.run_id != b.run_id
        assert set(_ours(a)).isdisjoint(_ours(b))
        # The same addresses in two separate worlds: each host answers with its own test bed's name.
        argv = [sys.executable, "-c", "import socket; print(socket.gethostbyaddr('10.77.0.11')[0])"]
        for c in (a, b):
            results = c.run_all([argv, None], timeout=30)
            assert results[0].returncode == 0 and results[0].output.strip() == "node1", results[0].output
    assert _ours(a) == [] and _ours(b) == []


@needs_netns
def test_teardown_on_error_and_timeout_kills_what_runs():
    with pytest.raises(RuntimeError, match="boom"):
        with Cluster(2, rate="1gbit") as c:
            results = c.run_all([["sleep", "100"], ["true"]], timeout=1)
            assert results[0].timed_out and results[1].returncode == 0
            assert cluster._netns_pids(c.hosts[0].netns) == []  # the sleeper was killed
            c.start_all([["sleep", "100"], ["sleep", "100"]])  # left running: down() kills them
            raise RuntimeError("boom")
    assert _ours(c) == []


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_teardown_when_the_creator_is_signalled(sig, tmp_path):
    ready = tmp_path / "ready"
    # The child starts with Python's usual signal handling even where the test runner was started
    # as a background job or under nohup (which ignore SIGINT or SIGHUP, and their children inherit
    # that: this test then timed out in a CI run launched with `&`).
    script = f"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
for s in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_DFL)
sys.path.insert(0, {str(ROOT)!r})
from tools.cluster import Cluster
with Cluster(2, rate="1gbit") as c:
    c.start_all([["sleep", "100"], ["sleep", "100"]])
    open({str(ready)!r}, "w").write(c.run_id)
    time.sleep(100)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        run_id = ready.read_text()
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            cluster.cleanup_stale()  # it did not tear down: leave no namespaces behind
    assert proc.returncode != 0
    assert [ns for ns in cluster._netns_list() if ns.startswith(run_id)] == []


@needs_netns
def test_cleanup_removes_only_test_beds_of_dead_creators(tmp_path):
    # A creator killed by SIGKILL leaves its test bed behind; cleanup_stale removes it...
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from tools.cluster import Cluster
c = Cluster(2, rate=None).up()
print(c.run_id, flush=True)
os.kill(os.getpid(), 9)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    run_id = out.stdout.strip()
    assert run_id and [ns for ns in cluster._netns_list() if ns.startswith(run_id)], out.stderr
    with Cluster(1, rate=None) as live:  # ...and leaves a live creator's alone
        removed = cluster.cleanup_stale()
        assert set(removed) >= {run_id, f"{run_id}-node0", f"{run_id}-node1"}
        assert _ours(live) != []
    assert [ns for ns in cluster._netns_list() if ns.startswith(run_id)] == []


PROBE = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tools.cluster import unavailable_reason
print(unavailable_reason())
"""


@needs_netns
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux's setpriv is not installed")
@pytest.mark.parametrize("drop", ["-net_admin,-sys_admin", "-net_admin"])
def test_without_the_capabilities_the_probe_says_why(drop):
    # Root without CAP_NET_ADMIN (and CAP_SYS_ADMIN): what a container without privileges gets.
    argv = ["setpriv", f"--bounding-set={drop}", "--inh-caps=-all", sys.executable, "-c", PROBE]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "not permitted" in out.stdout and "CAP_NET_ADMIN" in out.stdout, out.stdout


def test_without_iproute2_the_probe_says_why(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no ip, no tc
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "iproute2's `ip` is not installed" or not sys.platform.startswith("linux")
