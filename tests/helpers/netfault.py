"""Faults the network makes, for a mesh of processes inside a private network namespace: a
partition (every packet of a flow dropped, no RST: nothing errors until a timeout), a random
share of packets dropped, a port's bandwidth narrowed.

A process enters a namespace of its own with :func:`enter_private_network` (its loopback is
then private: the rules touch no other process on the host); every process it starts after
shares it. :class:`NetFaults` then changes the namespace's rules by the services' names:

- ``iptables`` rules in the OUTPUT chain (every loopback packet passes it once), matching a
  service's port (``--dport``: traffic to it, ``in``; ``--sport``: its answers, ``out``), or a
  service's process: the local ports of the connections it holds now (from ``ss``) and, for
  those it opens later, its cgroup (``-m cgroup --path``: a socket belongs to the cgroup its
  process was in when it opened it);
- ``tc`` ``htb`` on ``lo`` for bandwidth (``netem`` is not needed: a narrow link is a rate).

Everything needs root, ``iptables``, ``tc``, ``ss`` and a cgroup2 mount; a missing one is
reported by :func:`check_host` with what to do.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

_CLONE_NEWNET = 0x40000000
_TOOLS = ("iptables", "tc", "ss", "ip")
_DIRECTIONS = ("in", "out", "both")
_HTB_ROOT = "1:"
_HTB_DEFAULT_CLASS = "1:1"
_UNLIMITED_RATE = "100gbit"
_CGROUP2_FS = "cgroup2"


class NetFaultError(RuntimeError):
    """A fault that cannot be made: an unknown service, a bad argument, or a host that lacks
    what faults need (root, a tool, network namespaces); the message says which."""


def check_host(euid: int | None = None) -> None:
    """Raises NetFaultError naming what this host lacks to make network faults: root (``euid``,
    by default this process's), a tool, a cgroup2 mount or the right to create a network
    namespace."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise NetFaultError(
            f"network faults need root (iptables and tc change a namespace's rules); "
            f"running as uid {euid}"
        )
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        raise NetFaultError(
            f"{', '.join(missing)} not found: apt-get install iptables iproute2 "
            f"(make test installs them)"
        )
    if cgroup2_root() is None:
        raise NetFaultError("no cgroup2 file system is mounted (see /proc/mounts)")
    probe = subprocess.run(
        ["unshare", "--net", "true"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        raise NetFaultError(f"cannot create a network namespace: {probe.stderr.strip()}")


def cgroup2_root() -> Path | None:
    """Where the cgroup2 file system is mounted, if it is."""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == _CGROUP2_FS:
            return Path(fields[1])
    return None


def enter_private_network() -> None:
    """Moves this process into a new network namespace with its loopback up. Call it before
    any thread starts: a thread started earlier stays in the host's namespace."""
    check_host()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise NetFaultError(f"unshare(CLONE_NEWNET) failed: {os.strerror(error)}")
    _run(["ip", "link", "set", "lo", "up"])


@dataclasses.dataclass(frozen=True)
class Service:
    """A service of the mesh as faults name it: the port it listens on and, for faults on its
    own connections, its process id (0: a service that only listens, e.g. Redis)."""

    port: int
    pid: int = 0


class NetFaults:
    """The faults of one namespace, by service name; ``heal`` takes a service's back (all of
    them without a name). Use as a context manager: leaving heals everything and removes the
    cgroups it made."""

    def __init__(self, services: Mapping[str, Service], cgroup_name: str | None = None) -> None:
        check_host()
        self._services = dict(services)
        self._rules: dict[str, list[list[str]]] = {}  # service -> iptables rule specs
        self._narrowed: dict[str, tuple[float, str]] = {}  # service -> (Mb/s, direction)
        self._cgroup_before: dict[str, str] = {}  # service -> its process's cgroup before
        root = cgroup2_root()
        assert root is not None  # check_host
        self._cgroup_root = root
        self._cgroup_base = cgroup_name or f"infermesh-netfault-{os.getpid()}"

    def __enter__(self) -> NetFaults:
        return self

    def __exit__(self, *exc: object) -> None:
        self.heal()
        base = self._cgroup_root / self._cgroup_base
        if base.exists():
            for child in base.iterdir():
                if child.is_dir():
                    child.rmdir()
            base.rmdir()

    def service(self, name: str) -> Service:
        """The service ``name``; NetFaultError naming the known ones when there is none."""
        try:
            return self._services[name]
        except KeyError:
            known = ", ".join(sorted(self._services))
            raise NetFaultError(f"unknown service {name!r}; known: {known}") from None

    def partition(self, name: str, direction: str = "both") -> None:
        """Drops every packet to (``in``), from (``out``) or both ways of ``name``'s port."""
        self._add(name, [_port_match(self.service(name).port, d) for d in _sides(direction)])

    def drop(self, name: str, share: float, direction: str = "both") -> None:
        """Drops a random ``share`` (0 < share < 1) of the packets of ``name``'s port."""
        if not 0 < share < 1:
            raise NetFaultError(f"share: must be between 0 and 1 (exclusive), got {share}")
        chance = ["-m", "statistic", "--mode", "random", "--probability", f"{share:.6f}"]
        port = self.service(name).port
        self._add(name, [[*_port_match(port, d), *chance] for d in _sides(direction)])

    def black_hole(self, name: str, peer: str | None = None) -> None:
        """Cuts ``name``'s process off the network as a host that vanished would be: its port
        both ways, and every connection it holds or opens (with ``peer``: only those to
        ``peer``'s port, e.g. a gateway cut from Redis), without a reset."""
        service = self.service(name)
        if service.pid <= 0:
            raise NetFaultError(f"{name} has no process id: only its port can be partitioned")
        peer_port = self.service(peer).port if peer is not None else None
        matches = [] if peer is not None else [_port_match(service.port, d) for d in _SIDES]
        for local, remote in _connections(service.pid):
            if peer_port is None or remote == peer_port:
                matches += [
                    ["-p", "tcp", "--sport", str(local)],
                    ["-p", "tcp", "--dport", str(local)],
                ]
        cgroup = self._join_cgroup(name, service.pid)
        to_peer = [] if peer_port is None else ["-p", "tcp", "--dport", str(peer_port)]
        # connections it opens during the cut: what it sends is dropped, so none is made
        matches.append(["-m", "cgroup", "--path", cgroup, *to_peer])
        self._add(name, matches)

    def narrow(self, name: str, mbit_per_s: float, direction: str = "out") -> None:
        """Narrows the bandwidth of ``name``'s port to ``mbit_per_s`` (``out``: what it sends,
        ``in``: what is sent to it) with an htb class on ``lo``."""
        if mbit_per_s <= 0:
            raise NetFaultError(f"mbit_per_s: must be positive, got {mbit_per_s}")
        self.service(name)
        _sides(direction)
        self._narrowed[name] = (mbit_per_s, direction)
        self._apply_bandwidth()

    def heal(self, name: str | None = None) -> None:
        """Takes back ``name``'s faults (every service's without one)."""
        names = list(self._rules.keys() | self._narrowed.keys()) if name is None else [name]
        for each in names:
            self.service(each)
            for rule in self._rules.pop(each, []):
                _run(["iptables", "-D", "OUTPUT", *rule, "-j", "DROP"])
            if self._narrowed.pop(each, None) is not None:
                self._apply_bandwidth()
            self._leave_cgroup(each)

    def _add(self, name: str, matches: Sequence[list[str]]) -> None:
        for match in matches:
            _run(["iptables", "-A", "OUTPUT", *match, "-j", "DROP"])
            self._rules.setdefault(name, []).append(match)

    def _join_cgroup(self, name: str, pid: int) -> str:
        """Moves ``pid`` into a cgroup of its own; its path, as iptables names it."""
        relative = f"{self._cgroup_base}/{name}"
        path = self._cgroup_root / relative
        path.mkdir(parents=True, exist_ok=True)
        self._cgroup_before.setdefault(name, _cgroup_of(pid))
        (path / "cgroup.procs").write_text(str(pid))  # with all its threads
        return relative

    def _leave_cgroup(self, name: str) -> None:
        path = self._cgroup_root / self._cgroup_base / name
        if not path.exists():
            return
        before = self._cgroup_root / self._cgroup_before.pop(name, "").lstrip("/")
        for task in (path / "cgroup.procs").read_text().split():
            (before / "cgroup.procs").write_text(task)

    def _apply_bandwidth(self) -> None:
        """One htb tree on ``lo`` for every narrowed port, rebuilt from scratch."""
        subprocess.run(
            ["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False
        )
        if not self._narrowed:
            return
        _run(
            ["tc", "qdisc", "add", "dev", "lo", "root", "handle", _HTB_ROOT, "htb", "default", "1"]
        )
        _htb_class(_HTB_DEFAULT_CLASS, _UNLIMITED_RATE)
        for i, (name, (mbit, direction)) in enumerate(sorted(self._narrowed.items()), start=10):
            classid = f"1:{i}"
            _htb_class(classid, f"{mbit}mbit")
            port = str(self.service(name).port)
            for side in _sides(direction):
                field = "dport" if side == "in" else "sport"
                match = ["match", "ip", field, port, "0xffff", "flowid", classid]
                _run(
                    [
                        "tc",
                        "filter",
                        "add",
                        "dev",
                        "lo",
                        "parent",
                        _HTB_ROOT,
                        "protocol",
                        "ip",
                        "prio",
                        "1",
                        "u32",
                        *match,
                    ]
                )


_SIDES = ("in", "out")


def _sides(direction: str) -> tuple[str, ...]:
    if direction not in _DIRECTIONS:
        raise NetFaultError(f"direction: one of {', '.join(_DIRECTIONS)}, got {direction!r}")
    return _SIDES if direction == "both" else (direction,)


def _port_match(port: int, side: str) -> list[str]:
    return ["-p", "tcp", "--dport" if side == "in" else "--sport", str(port)]


def _connections(pid: int) -> Iterator[tuple[int, int]]:
    """(local port, remote port) of every TCP connection process ``pid`` holds."""
    listing = _run(["ss", "-Htnp", "state", "established"])
    owner = re.compile(rf"pid={pid},")
    for line in listing.splitlines():
        if not owner.search(line):
            continue
        fields = line.split()
        local, remote = fields[2], fields[3]
        yield int(local.rsplit(":", 1)[1]), int(remote.rsplit(":", 1)[1])


def _htb_class(classid: str, rate: str) -> None:
    """An htb class under the root of ``lo``, held to ``rate`` (no borrowing past it)."""
    _run(
        [
            "tc",
            "class",
            "add",
            "dev",
            "lo",
            "parent",
            _HTB_ROOT,
            "classid",
            classid,
            "htb",
            "rate",
            rate,
            "ceil",
            rate,
        ]
    )


def _cgroup_of(pid: int) -> str:
    """Process ``pid``'s cgroup2 path (its ``0::`` line), relative to the mount."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return "/"


def _run(command: Sequence[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetFaultError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result.stdout
