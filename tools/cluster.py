"""A cluster on one Linux machine: hosts in network namespaces, joined by rate-limited links.

Each host is a network namespace with its own loopback, hostname and address on a private subnet
(``10.77.0.0/24`` by default: nothing outside the run's namespaces has an address on it or can
reach it). The hosts hang off a bridge that lives in a namespace of its own, like machines on a
switch. Every link is capped with a ``tbf`` qdisc on *both* ends of its veth pair: the host's end
shapes what the host sends, the switch's end what it receives, so each host gets ``rate`` up and
``rate`` down at once, as on a full-duplex NIC. Names carry the creating process's id and a random
suffix, so runs side by side never collide, and everything is removed again on exit: by the
context manager, on SIGTERM/SIGHUP, and at interpreter exit (``atexit``). Only a SIGKILL can leave
a test bed behind; ``python tools/cluster.py cleanup`` removes those of processes that are gone.

As a library (tests and benchmarks)::

    from tools.cluster import Cluster, unavailable_reason

    if (reason := unavailable_reason()) is None:
        with Cluster(2, rate="1gbit") as c:
            results = c.run_all([["hostname"], ["hostname"]], timeout=10)
            print([r.output for r in results])  # ['node0\\n', 'node1\\n']

As a command::

    python tools/cluster.py check                       # can this machine make one? (needs root)
    python tools/cluster.py up --hosts 2 --rate 1gbit   # make one, print how to enter it, wait
    python tools/cluster.py run --hosts 4 -- sh -c 'echo $FDDP_HOST $FDDP_ADDR'
    python tools/cluster.py torchrun --hosts 2 --nproc-per-node 2 -- examples/train_digits.py
    python tools/cluster.py measure --hosts 2 --rate 1gbit   # check the shaping: TCP and gloo
    python tools/cluster.py cleanup                     # remove test beds of killed runs

Needs Linux, iproute2 (``ip``, ``tc``) and CAP_NET_ADMIN (root); ``unavailable_reason()`` says
what is missing.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

__all__ = [
    "Cluster",
    "Host",
    "Result",
    "unavailable_reason",
    "parse_rate",
    "cleanup_stale",
    "measure_tcp",
    "measure_gloo",
]

PREFIX = "fddp"  # every namespace this module makes is named fddp-<pid>-<6 hex>[-<host>]
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})(?:-([a-z][a-z0-9]*))?$")
_HOST_RE = re.compile(r"^[a-z][a-z0-9]{0,31}$")
IFNAME = "eth0"  # every host's interface to the switch, inside its own namespace
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/* over /etc/*
BURST_S = 0.001  # tbf bucket: 1 ms of traffic at the link rate (at least 64 KiB, one GSO segment)
QUEUE_S = 0.1  # tbf queue: 100 ms at the link rate before it drops


# ------------------------------------------------------------------------------------------ helpers


def parse_rate(rate: str | int | float) -> int:
    """Return a link rate in bits per second: ``"1gbit"``, ``"100mbit"``, ``"2.5gbit"``, or a number.

    Example:
        >>> parse_rate("1gbit"), parse_rate("100mbit"), parse_rate(5e8)
        (1000000000, 100000000, 500000000)
    """
    if isinstance(rate, (int, float)):
        if rate <= 0:
            raise ValueError(f"link rate must be positive, got {rate!r}")
        return int(rate)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r}: expected a number of bits/s or e.g. '100mbit', '1gbit', '10gbit'")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[m.group(2)]
    return int(float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1))  # tc's "bps" is bytes/s


def format_rate(bits_per_s: float) -> str:
    """``1e9 -> '1gbit'``: the form used in file names and tables."""
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def _sh(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_list() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = _sh(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_netns_processes(namespaces: Iterable[str], wait_s: float = 5.0) -> None:
    """SIGKILL every process inside ``namespaces`` (namespaces this module made), and wait for them.

    Lists again after each round: a process may have started another (torchrun restarting its
    workers) between the listing and the kill.
    """
    namespaces = list(namespaces)
    deadline = time.monotonic() + wait_s
    while True:
        # A killed child of ours stays a zombie until reaped; a zombie holds no namespace.
        pids = {p for ns in namespaces for p in _netns_pids(ns) if p != os.getpid() and not _is_zombie(p)}
        if not pids or time.monotonic() > deadline:
            return
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


_probe_result: list[str | None] = []


def unavailable_reason() -> str | None:
    """Return why this machine cannot make a test bed (for ``pytest.skip``), or None if it can.

    Tries what a test bed needs, once per process: a namespace, a veth pair into it and a ``tbf``
    qdisc on it; removes them again.

    Example:
        >>> reason = unavailable_reason()
        >>> reason is None or isinstance(reason, str)
        True
    """
    if _probe_result:
        return _probe_result[0]
    _probe_result.append(_probe())
    return _probe_result[0]


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not installed"
    if shutil.which("unshare") is None:
        return "util-linux's `unshare` is not installed"
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
    made: list[str] = []
    try:
        for ns in (name, f"{name}-probe"):
            proc = _sh(["ip", "netns", "add", ns], check=False)
            if proc.returncode != 0:
                euid = os.geteuid()
                return (f"`ip netns add` is not permitted ({proc.stderr.strip()}); it needs CAP_NET_ADMIN "
                        f"(root){'' if euid == 0 else f', and this process runs as uid {euid}'}")  # fmt: skip
            made.append(ns)
        try:
            (NETNS_ETC / made[1]).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / made[1] / "hosts").write_text("127.0.0.1 localhost\n")
        except OSError as e:
            return f"cannot write {NETNS_ETC} (the hosts' /etc/hosts): {e}"
        steps = [
            ["ip", "link", "add", IFNAME, "netns", made[1], "type", "veth", "peer", "name", "p0", "netns", made[0]],
            ["tc", "-n", made[1], "qdisc", "add", "dev", IFNAME, "root", *_tbf_args(10**9)],
            [
                "ip",
                "netns",
                "exec",
                made[1],
                "unshare",
                "--uts",
                "sh",
                "-c",
                "printf probe > /proc/sys/kernel/hostname",
            ],
        ]
        for argv in steps:
            proc = _sh(argv, check=False)
            if proc.returncode != 0:
                hint = " (needs CAP_NET_ADMIN: root)" if "not permitted" in proc.stderr else ""
                return f"`{shlex.join(argv)}` failed: {proc.stderr.strip()}{hint}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"making a network namespace failed: {e}"
    finally:
        for ns in reversed(made):
            _sh(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def _tbf_args(bits_per_s: int, burst_s: float = BURST_S) -> list[str]:
    """A token bucket for one direction of a link: ``burst_s`` of traffic at the rate (at least one
    64 KiB GSO segment) and a 100 ms queue."""
    bytes_per_s = bits_per_s / 8
    burst = max(int(bytes_per_s * burst_s), 64 * 1024 + 1514)
    limit = max(int(bytes_per_s * QUEUE_S), 4 * burst)
    return ["tbf", "rate", f"{bits_per_s}bit", "burst", str(burst), "limit", str(limit)]


# ---------------------------------------------------------------------------------------- the cluster


class Host(NamedTuple):
    """One host of a test bed."""

    index: int  # position in the cluster: 0 is the one that hosts the rendezvous
    name: str  # its hostname (inside its own UTS namespace) and its name in the others' /etc/hosts
    netns: str  # its network namespace, `ip netns exec <netns> ...`
    addr: str  # its address on the switch
    ifname: str  # its interface to the switch: GLOO_SOCKET_IFNAME


class Result(NamedTuple):
    """What a command run on a host left behind."""

    host: Host
    returncode: int | None  # None: killed at the timeout
    output: str  # stdout and stderr, interleaved

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


_live: set["Cluster"] = set()
_live_lock = threading.RLock()
_previous_handlers: dict[int, object] = {}


def _teardown_all() -> None:
    with _live_lock:
        clusters = list(_live)
    for c in clusters:
        c.down()


def _on_signal(signum: int, frame: object) -> None:
    _teardown_all()
    previous = _previous_handlers.get(signum)
    if callable(previous):
        previous(signum, frame)
    else:  # the default action (None: a handler set outside Python, treated as the default)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    """Tear down on SIGTERM and SIGHUP too (SIGINT raises KeyboardInterrupt, which unwinds ``with``)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still runs
    for sig in (signal.SIGTERM, signal.SIGHUP):
        current = signal.getsignal(sig)
        if current == signal.SIG_IGN:
            continue  # this process outlives the signal (nohup, say), and so must its test beds
        if current is not _on_signal:
            _previous_handlers[sig] = current
            signal.signal(sig, _on_signal)


atexit.register(_teardown_all)


class Cluster:
    """``hosts`` network namespaces on a bridge, each link capped at ``rate`` in both directions.

    Args:
        hosts: the number of hosts (named ``node0``, ``node1``, ...) or their names (lower-case
            letters and digits, starting with a letter).
        rate: each host's link rate, as tc writes it (``"1gbit"``, ``"100mbit"``) or in bits/s;
            None leaves the links unshaped (veth speed: memory copies).
        subnet: the private subnet the hosts' addresses come from. Host k gets the subnet's
            address ``10 + k``: up to 90 hosts, their addresses have two digits and sort, as
            strings, like the hosts (torchrun's c10d rendezvous numbers the nodes that way).
        mtu: the links' MTU.
        burst_s: the token bucket's depth, in seconds of traffic at ``rate``: an idle link lets
            this much through at memory speed, where a real NIC would serialise it at ``rate``.

    Example:
        >>> with Cluster(["a", "b"], rate="100mbit") as c:
        ...     [h.addr for h in c.hosts]
        ['10.77.0.10', '10.77.0.11']
    """

    def __init__(
        self,
        hosts: int | Sequence[str] = 2,
        rate: str | int | float | None = "1gbit",
        *,
        subnet: str = "10.77.0.0/24",
        mtu: int = 1500,
        burst_s: float = BURST_S,
    ) -> None:
        names = [f"node{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not names:
            raise ValueError("a cluster needs at least one host")
        for n in names:
            if not _HOST_RE.match(n):
                raise ValueError(f"host name {n!r}: use lower-case letters and digits, starting with a letter")
        if len(set(names)) != len(names):
            raise ValueError(f"host names must differ, got {names}")
        if len(names) > 90:
            raise ValueError(f"{len(names)} hosts: at most 90 (their addresses must sort like the hosts)")
        net = ipaddress.ip_network(subnet)
        if net.version != 4 or net.prefixlen > 24:
            raise ValueError(f"subnet {subnet}: give an IPv4 subnet of /24 or larger")
        self.rate_bps = None if rate is None else parse_rate(rate)
        self.run_id = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch_netns = self.run_id
        self.prefixlen = net.prefixlen
        self.mtu = mtu
        self.burst_s = burst_s
        self.hosts = [
            Host(i, n, f"{self.run_id}-{n}", str(net.network_address + 10 + i), IFNAME) for i, n in enumerate(names)
        ]
        self._made: list[str] = []  # namespaces that exist, in creation order
        self._lock = threading.RLock()
        self._tmp: str | None = None

    # -- lifecycle

    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> "Cluster":
        """Make the namespaces, links, addresses and qdiscs; on any failure, remove what was made."""
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot make a test bed here: {reason}")
        with _live_lock:
            _live.add(self)
        _install_handlers()
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        sw = self.switch_netns
        self._add_netns(sw)
        self._ip(sw, "link", "set", "lo", "up")
        self._ip(sw, "link", "add", "sw", "type", "bridge")
        self._ip(sw, "link", "set", "sw", "up")
        # The v4-mapped forms too: torch's TCPStore listens on a dual-stack socket and looks its
        # clients up by those (no DNS server is reachable from the namespaces).
        hosts_file = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{h.addr} {h.name}\n::ffff:{h.addr} {h.name}\n" for h in self.hosts
        )
        for h in self.hosts:
            port = f"p{h.index}"
            self._add_netns(h.netns)
            etc = NETNS_ETC / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)  # the hosts know each other by name
            # Made inside the namespaces directly: the names never exist in the caller's namespace.
            _sh(["ip", "link", "add", h.ifname, "netns", h.netns, "mtu", str(self.mtu), "type", "veth",
                 "peer", "name", port, "netns", sw, "mtu", str(self.mtu)])  # fmt: skip
            self._ip(sw, "link", "set", port, "master", "sw")
            self._ip(sw, "link", "set", port, "up")
            self._ip(h.netns, "link", "set", "lo", "up")
            self._ip(h.netns, "addr", "add", f"{h.addr}/{self.prefixlen}", "dev", h.ifname)
            self._ip(h.netns, "link", "set", h.ifname, "up")
            if self.rate_bps is not None:
                # Egress on both ends: the host's end caps what it sends, the switch's what it gets.
                for ns, dev in ((h.netns, h.ifname), (sw, port)):
                    _sh(
                        [
                            "tc",
                            "-n",
                            ns,
                            "qdisc",
                            "replace",
                            "dev",
                            dev,
                            "root",
                            *_tbf_args(self.rate_bps, self.burst_s),
                        ]
                    )

    def _add_netns(self, ns: str) -> None:
        _sh(["ip", "netns", "add", ns])
        self._made.append(ns)

    @staticmethod
    def _ip(ns: str, *args: str) -> None:
        _sh(["ip", "-n", ns, *args])

    def down(self) -> None:
        """Kill every process in the cluster's namespaces and remove them (idempotent)."""
        with self._lock:
            if self._made:
                _kill_netns_processes(self._made)
                for ns in reversed(self._made):
                    # Deleting a host's namespace destroys its veth pair, and the switch's end with it.
                    with contextlib.suppress(Exception):
                        _sh(["ip", "netns", "del", ns], check=False)
                    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
                self._made.clear()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None
        with _live_lock:
            _live.discard(self)

    # -- running commands

    def host(self, host: Host | int | str) -> Host:
        """The host with this index or name."""
        if isinstance(host, Host):
            return host
        for h in self.hosts:
            if host in (h.index, h.name):
                return h
        raise KeyError(f"no host {host!r} in {[h.name for h in self.hosts]}")

    def env(self, host: Host | int | str, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment for a command on ``host``: ``base`` (default: this process's) plus the
        interface names gloo (and NCCL, TensorPipe) must bind to, and the host's identity."""
        h = self.host(host)
        env = dict(os.environ if base is None else base)
        env.update(
            GLOO_SOCKET_IFNAME=h.ifname,
            NCCL_SOCKET_IFNAME=h.ifname,
            TP_SOCKET_IFNAME=h.ifname,
            FDDP_HOST=h.name,
            FDDP_HOST_INDEX=str(h.index),
            FDDP_ADDR=h.addr,
            FDDP_MASTER=self.hosts[0].addr,
            FDDP_NHOSTS=str(len(self.hosts)),
        )
        return env

    def command(self, host: Host | int | str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run on ``host``: in its network namespace, under its own hostname."""
        h = self.host(host)
        set_hostname = 'printf %s "$0" > /proc/sys/kernel/hostname && exec "$@"'  # in its own UTS namespace
        return ["ip", "netns", "exec", h.netns, "unshare", "--uts", "sh", "-c", set_hostname, h.name, *argv]

    def popen(self, host: Host | int | str, argv: Sequence[str], *, env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen:  # fmt: skip
        """Start ``argv`` on ``host``; ``env`` (default: ``self.env(host)``) is its environment."""
        if not self._made:
            raise RuntimeError("the cluster is not up: use `with Cluster(...) as c:` or call up()")
        return subprocess.Popen(self.command(host, argv), env=self.env(host) if env is None else env, **kwargs)

    def run_all(
        self,
        argvs: Sequence[Sequence[str] | None],
        timeout: float,
        *,
        envs: Sequence[dict[str, str] | None] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> list[Result]:
        """Run ``argvs[k]`` on host k (None: nothing), all at once; wait up to ``timeout`` seconds.

        At the timeout every process in the cluster's namespaces is killed and the unfinished
        commands report ``returncode=None``.
        """
        return self.start_all(argvs, envs=envs, cwd=cwd).wait(timeout)

    def start_all(
        self,
        argvs: Sequence[Sequence[str] | None],
        *,
        envs: Sequence[dict[str, str] | None] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> "Running":
        """Start ``argvs[k]`` on host k (None: nothing) and return at once; ``.wait(timeout)`` collects.

        Outputs go to files, not pipes, so a process that outlives the command cannot keep anyone
        waiting on a pipe.
        """
        if len(argvs) != len(self.hosts):
            raise ValueError(f"{len(argvs)} commands for {len(self.hosts)} hosts")
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix=f"{self.run_id}-")
        started = []
        for h, argv in zip(self.hosts, argvs):
            if argv is None:
                continue
            log = Path(self._tmp) / f"{h.name}-{secrets.token_hex(3)}.log"
            env = None if envs is None or envs[h.index] is None else envs[h.index]
            with open(log, "w") as f:
                proc = self.popen(h, argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
            started.append((h, proc, log))
        return Running(self, started)

    def kill_processes(self) -> None:
        """SIGKILL every process still running in the cluster's namespaces."""
        _kill_netns_processes(self._made)

    def power_off(self, host: Host | int | str) -> None:
        """Lose ``host`` as a power cut would: its link goes down first, so that no FIN or RST
        reaches its peers (they learn of it only by timeouts), then every process on it is killed."""
        h = self.host(host)
        _sh(["ip", "-n", h.netns, "link", "set", h.ifname, "down"])
        _kill_netns_processes([h.netns])

    def torchrun(
        self,
        host: Host | int | str,
        script_args: Sequence[str],
        *,
        nproc_per_node: int = 1,
        nnodes: int | str | None = None,
        port: int = 29400,
        rdzv_id: str | None = None,
        max_restarts: int = 0,
        rdzv_conf: dict[str, object] | None = None,
        python: str = sys.executable,
    ) -> list[str]:
        """The argv of one torchrun agent on ``host`` for a multi-node launch across the cluster.

        The c10d rendezvous is hosted by host 0's agent at ``node0:port``. ``--local-addr`` names
        each agent by its address: c10d numbers the nodes by sorting those names, so host k runs
        ranks ``k * nproc_per_node`` onwards (the addresses sort like the hosts).
        """
        h = self.host(host)
        conf = ",".join(f"{k}={v}" for k, v in (rdzv_conf or {}).items())
        return [
            python, "-m", "torch.distributed.run",
            f"--nnodes={nnodes if nnodes is not None else len(self.hosts)}",
            f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.hosts[0].name}:{port}",
            f"--rdzv-id={rdzv_id or self.run_id}",
            f"--local-addr={h.addr}",
            f"--max-restarts={max_restarts}",
            *([f"--rdzv-conf={conf}"] if conf else []),
            *script_args,
        ]  # fmt: skip

    def describe(self) -> str:
        rate = "unshaped" if self.rate_bps is None else f"{format_rate(self.rate_bps)} each way"
        lines = [f"test bed {self.run_id}: {len(self.hosts)} hosts on a bridge, links {rate}"]
        for h in self.hosts:
            lines.append(f"  {h.name:<8} {h.addr:<15} {h.ifname}  ip netns exec {h.netns} bash")
        return "\n".join(lines)


class Running:
    """Commands started on a cluster's hosts by ``Cluster.start_all``."""

    def __init__(self, cluster: Cluster, started: list[tuple[Host, subprocess.Popen, Path]]) -> None:
        self.cluster, self.started = cluster, started

    def output(self, host: Host | int | str) -> str:
        """What the command on ``host`` has written so far."""
        h = self.cluster.host(host)
        return next(log.read_text(errors="replace") for g, _, log in self.started if g == h)

    def wait(self, timeout: float) -> list[Result]:
        """Wait up to ``timeout`` seconds for every command; then kill whatever still runs in the
        cluster (the unfinished commands report ``returncode=None``) and return the results."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int | None] = {}
        for h, proc, _ in self.started:
            try:
                codes[h.index] = proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                codes[h.index] = None
        if any(c is None for c in codes.values()):
            self.cluster.kill_processes()
            for _, proc, _ in self.started:
                proc.wait()
        return [Result(h, codes[h.index], log.read_text(errors="replace")) for h, _, log in self.started]


def cleanup_stale(include_live: bool = False) -> list[str]:
    """Remove the test beds (namespaces, their processes, /etc/netns entries) whose creator is gone.

    A SIGKILLed creator cannot clean up after itself. Namespaces of live processes are left alone
    unless ``include_live``. Returns the names removed.
    """
    removed = []
    stale = [ns for ns in _netns_list() if (m := _NAME_RE.match(ns)) and (include_live or not _pid_alive(int(m[1])))]
    _kill_netns_processes(stale)
    for ns in sorted(stale, key=lambda n: n.count("-"), reverse=True):  # hosts before their switch
        if _sh(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.iterdir():
            m = _NAME_RE.match(d.name)
            if m and (include_live or not _pid_alive(int(m[1]))) and d.name not in _netns_list():
                shutil.rmtree(d, ignore_errors=True)
    return removed


# -------------------------------------------------------------------------------------- measurements

_TCP_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
while True:
    k = c.recv_into(buf)
    if not k: break
    if t0 is None: t0 = time.perf_counter()
    n += k
print(n, time.perf_counter() - t0, flush=True)
"""

_TCP_SOURCE = """
import socket, sys, time
for _ in range(200):
    try: s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
chunk = bytes(1 << 20); n = int(sys.argv[3])
for _ in range(n // len(chunk)): s.sendall(chunk)
s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
"""


def measure_tcp(cluster: Cluster, src: int = 0, dst: int = 1, nbytes: int = 64 << 20, timeout: float = 60) -> float:
    """Send ``nbytes`` over one TCP connection from host ``src`` to host ``dst``; return bits/s received.

    The receiver's clock starts at the first byte, so the connection's set-up is not counted.
    """
    port = "5201"
    argvs: list[list[str] | None] = [None] * len(cluster.hosts)
    argvs[dst] = [sys.executable, "-c", _TCP_SINK, port]
    argvs[src] = [sys.executable, "-c", _TCP_SOURCE, cluster.hosts[dst].addr, port, str(nbytes)]
    results = {r.host.index: r for r in cluster.run_all(argvs, timeout=timeout)}
    sink = results[dst]
    if sink.returncode != 0 or results[src].returncode != 0:
        raise RuntimeError(f"TCP measurement failed:\n{sink.output}\n{results[src].output}")
    n, seconds = sink.output.split()[-2:]
    return 8 * int(n) / float(seconds)


def measure_gloo(
    cluster: Cluster, nbytes: int = 8 << 20, repeats: int = 10, nproc_per_node: int = 1, timeout: float = 120
) -> dict[str, float]:
    """Time a gloo all-reduce of ``nbytes`` of float32 across the cluster (one torchrun agent per
    host); return the median and minimum seconds and the bus bandwidth implied by the median."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "allreduce.py"
    out = Path(tempfile.mkdtemp(prefix=f"{cluster.run_id}-gloo-"))
    try:
        args = [str(script), "--sizes", str(nbytes), "--repeats", str(repeats), "--out", str(out / "r.json")]
        argvs = [cluster.torchrun(h, args, nproc_per_node=nproc_per_node) for h in cluster.hosts]
        results = cluster.run_all(argvs, timeout=timeout)
        bad = [r for r in results if r.returncode != 0]
        if bad:
            raise RuntimeError("gloo measurement failed:\n" + "\n".join(f"--- {r.host.name}\n{r.output}" for r in bad))
        return json.loads((out / "r.json").read_text())["sizes"][0]
    finally:
        shutil.rmtree(out, ignore_errors=True)


# --------------------------------------------------------------------------------------------- CLI


def _hosts_arg(s: str) -> int | list[str]:
    return int(s) if s.isdigit() else [n.strip() for n in s.split(",") if n.strip()]


def _rate_arg(s: str) -> str | None:
    return None if s.lower() in ("none", "unshaped", "0") else s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say whether this machine can make a test bed, and why not")
    cleanup = sub.add_parser("cleanup", help="remove test beds whose creating process is gone")
    cleanup.add_argument("--all", action="store_true", help="also those of live processes (careful)")
    for name, help_ in [
        ("up", "make a test bed, print how to enter its hosts, wait for Ctrl-C"),
        ("run", "run a command on every host (in parallel); exit with the worst exit code"),
        ("torchrun", "one torchrun agent per host: a multi-node launch of a script"),
        ("measure", "check the shaping: TCP throughput both ways and a gloo all-reduce"),
    ]:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--hosts", type=_hosts_arg, default=2, help="a number of hosts or their names, comma-separated")
        p.add_argument("--rate", type=_rate_arg, default="1gbit", help="each host's link rate (tc syntax), or 'none'")
        if name in ("run", "torchrun"):
            p.add_argument("--timeout", type=float, default=600)
        if name == "torchrun":
            p.add_argument("--nproc-per-node", type=int, default=1)
            p.add_argument("--max-restarts", type=int, default=0)
        if name in ("run", "torchrun"):
            p.add_argument(
                "command", nargs=argparse.REMAINDER, help="after --: the command (run) or script and its args"
            )
    args = parser.parse_args(argv)

    if args.cmd == "check":
        reason = unavailable_reason()
        print("ok: this machine can make test beds" if reason is None else f"unavailable: {reason}")
        return 0 if reason is None else 1
    if args.cmd == "cleanup":
        removed = cleanup_stale(include_live=args.all)
        print(f"removed {len(removed)} namespaces" + "".join(f"\n  {n}" for n in removed))
        return 0
    reason = unavailable_reason()
    if reason is not None:
        print(f"unavailable: {reason}", file=sys.stderr)
        return 1
    command = list(getattr(args, "command", []))
    if command[:1] == ["--"]:
        command = command[1:]
    if args.cmd in ("run", "torchrun") and not command:
        parser.error(f"{args.cmd}: give the command after --")
    with Cluster(args.hosts, rate=args.rate) as c:
        print(c.describe(), flush=True)
        if args.cmd == "up":
            print("Ctrl-C (or SIGTERM) removes it.", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
            return 0
        if args.cmd == "measure":
            return _measure(c)
        if args.cmd == "run":
            argvs = [command] * len(c.hosts)
        else:
            argvs = [
                c.torchrun(h, command, nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts)
                for h in c.hosts
            ]
        results = c.run_all(argvs, timeout=args.timeout)
        worst = 0
        for r in results:
            status = "timed out" if r.timed_out else f"exit {r.returncode}"
            print(
                f"--- {r.host.name} ({r.host.addr}): {status}\n{r.output}", end="" if r.output.endswith("\n") else "\n"
            )
            worst = max(worst, 124 if r.timed_out else abs(r.returncode))
        return worst


def _measure(c: Cluster) -> int:
    nominal = c.rate_bps
    report = {"hosts": len(c.hosts), "rate_bps": nominal}
    if len(c.hosts) >= 2:
        fwd = measure_tcp(c, 0, 1)
        back = measure_tcp(c, 1, 0)
        report["tcp_bps"] = [fwd, back]
        print(f"TCP {c.hosts[0].name} -> {c.hosts[1].name}: {fwd / 1e9:.3f} Gbit/s; back: {back / 1e9:.3f} Gbit/s"
              + ("" if nominal is None else f" (link {nominal / 1e9:g} Gbit/s)"), flush=True)  # fmt: skip
    g = measure_gloo(c)
    report["gloo_allreduce_8MiB"] = g
    n = len(c.hosts)
    line = f"gloo all-reduce of 8 MiB over {n} hosts: median {1e3 * g['median_s']:.1f} ms"
    if nominal is not None:
        ideal = 2 * (n - 1) / n * g["bytes"] * 8 / nominal
        line += f" (a ring at the link rate: {1e3 * ideal:.1f} ms)"
    print(line)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
