"""The lab's network: N node namespaces on two bridges of the root namespace.

::

    root namespace                            node namespace ftlab<PID>x<i>
    bridge ftlb<PID>d (data, no address)  <-- veth fl<PID>d<i> / eth0 10.<D>.<K>.(i+1)
    bridge ftlb<PID>c 10.<C>.<K>.254      <-- veth fl<PID>c<i> / ctl0 10.<C>.<K>.(i+1)
      the arbiter, Prometheus and the test itself live here, on the control bridge

The training fabric (gloo, GLOO_SOCKET_IFNAME=eth0) and the control network (agents <->
arbiter, Prometheus scrapes) are separate, as a cluster's management network is separate
from its training fabric: cutting a node's data link must not also cut it off from the
arbiter (its NIC fault would only arrive after the link came back). A NIC fault is the
root end of the node's data veth going down: the node sees its carrier drop (IFF_UP still
set), a real netlink event, as a pulled cable or a switch port going down.

Names carry the creating process's pid, so a leftover from a killed run (namespaces,
bridges, veths, processes inside the namespaces) is found and removed by the next
``sweep()`` once that pid is gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass, field

from tests.netns import ip

PREFIX = "ftlab"  # namespaces: ftlab<PID>x<i>
BRIDGE = "ftlb"  # bridges: ftlb<PID>d / ftlb<PID>c
VETH = "fl"  # root ends: fl<PID>d<i> / fl<PID>c<i>
_NS = re.compile(rf"^{PREFIX}(\d+)x\d+$")
_LINK = re.compile(rf"^(?:{BRIDGE}(\d+)[dc]|{VETH}(\d+)[dc]\d+)$")
DATA_NET, CTL_NET = 92, 93  # 10.92.K.0/24 and 10.93.K.0/24


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(ns: str) -> int:
    """SIGKILL every process inside ``ns`` (``ip netns pids``); how many there were."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                         timeout=30).stdout.split()
    n = 0
    for pid in out:
        try:
            os.kill(int(pid), signal.SIGKILL)
            n += 1
        except (ProcessLookupError, ValueError):
            pass
    return n


def sweep(own_pid: int | None = None) -> list[str]:
    """Remove the namespaces and links of labs whose creating process is gone (or of
    ``own_pid``, on close); the names removed."""
    removed: list[str] = []
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NS.match(name)
        if m and (int(m.group(1)) == own_pid or (own_pid is None and
                                                  not _alive(int(m.group(1))))):
            kill_namespace_processes(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _LINK.match(name)
        if not m:
            continue
        pid = int(m.group(1) or m.group(2))
        if pid == own_pid or (own_pid is None and not _alive(pid)):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _subnet_free(k: int) -> bool:
    used = ip("-o", "addr", "show", check=False)
    return f"10.{DATA_NET}.{k}." not in used and f"10.{CTL_NET}.{k}." not in used


@dataclass
class Network:
    """Bridges and node namespaces of one lab; ``close()`` removes all of it."""

    nodes: int
    pid: int = field(default_factory=os.getpid)
    k: int = 0
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    def data_ip(self, i: int) -> str:
        return f"10.{DATA_NET}.{self.k}.{i + 1}"

    def ctl_ip(self, i: int) -> str:
        return f"10.{CTL_NET}.{self.k}.{i + 1}"

    @property
    def host_ip(self) -> str:
        """The root namespace's address on the control bridge (arbiter, Prometheus)."""
        return f"10.{CTL_NET}.{self.k}.254"

    def data_link(self, i: int) -> str:
        """The root end of node ``i``'s data veth: down = the node loses its carrier."""
        return f"{VETH}{self.pid}d{i}"

    def create(self) -> Network:
        sweep()
        k = self.pid % 250
        while not _subnet_free(k):
            k = (k + 1) % 250
        self.k = k
        for kind in ("d", "c"):
            br = f"{BRIDGE}{self.pid}{kind}"
            ip("link", "add", br, "type", "bridge")
            self.links.append(br)
            ip("link", "set", br, "up")
        ip("addr", "add", f"{self.host_ip}/24", "dev", f"{BRIDGE}{self.pid}c")
        for i in range(self.nodes):
            ns = f"{PREFIX}{self.pid}x{i}"
            ip("netns", "add", ns)
            self.namespaces.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
            for kind, inner, addr in (("d", "eth0", self.data_ip(i)),
                                      ("c", "ctl0", self.ctl_ip(i))):
                outer = f"{VETH}{self.pid}{kind}{i}"
                # distinct ifindex on the two ends: carrier events at once (tests/netns.py)
                ip("link", "add", outer, "type", "veth", "peer", "name", inner,
                   "index", str(5000 + 2 * i + (kind == "c")), "netns", ns)
                self.links.append(outer)
                ip("link", "set", outer, "master", f"{BRIDGE}{self.pid}{kind}", "up")
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
                ip("-n", ns, "link", "set", inner, "up")
        return self

    def close(self) -> None:
        for ns in self.namespaces:
            kill_namespace_processes(ns)
            ip("netns", "del", ns, check=False)
        for link in reversed(self.links):
            ip("link", "del", link, check=False)
        self.namespaces.clear()
        self.links.clear()
