"""Xids from the kernel log: parse NVRM Xid and NVSwitch SXid lines, read ``/dev/kmsg``.

The driver logs every Xid, also where NVML events are not delivered (a GPU that fell off
the bus, an event queue that overflowed)::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=2130, name=python3, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:86:00): 31, pid='<unknown>', name=<unknown>, Ch 00000008, ...
    NVRM: Xid (0000:01:00): 13, 0003 00000000 0000a1c0 ...      (old drivers: no PCI:)
    nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 20034, Fatal, Link 30 LTSSM Fault Up

as ``/dev/kmsg`` records (``6,1234,5678901,-;NVRM: ...``), ``dmesg`` lines
(``[ 5678.901234] NVRM: ...``) or journal lines (``... kernel: NVRM: ...``).
``parse_line`` reads all of these, with the Xid where the kernel message starts (never text
quoted inside another message); ``pci_key`` makes the kernel's ``0000:3b:00`` and NVML's
``00000000:3B:00.0`` the same GPU, and an Xid of a bus id that is none of this host's
GPUs is dropped by the GPU source. Records user space wrote into ``/dev/kmsg`` are not
read.

``KmsgReader`` reads in a thread: ``/dev/kmsg`` (a character device) from *now* on -- old
records are stale: replaying them would re-raise faults fixed long ago -- one record per
read; a FIFO or a regular file from its start, by lines, following a file's growth. It
blocks in ``poll`` with a wake-up pipe for ``stop``: no busy wait, and memory is one
read buffer whatever the kernel logs.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("ftagent.sources.kmsg")

KMSG = "/dev/kmsg"
RECORD = 8192  # /dev/kmsg returns one record per read; a shorter buffer is EINVAL
FILE_POLL = 0.25  # seconds between looks at a regular file that reached its end
MAX_LINE = 4096  # longer lines (not the kernel's) are cut before parsing

_PCI = r"(?:PCI:)?([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.([0-7]))?"
# Where a kernel message starts in the line shapes we read: a /dev/kmsg record's header
# (``6,1234,5678901,-;``), dmesg's time stamp (``[ 5678.901234] ``, ``-T``'s ``[Wed ...]``),
# a journal or syslog line's ``... HOST kernel: ``. Xid and SXid must be where the
# message starts: text quoted inside another message (``tmpfs: Unknown parameter 'NVRM:
# Xid (PCI:0000:18:00): 79'``, which any user who may mount can make the kernel log) is
# not the driver speaking. Every part is bounded and the classes are disjoint, so a match
# is linear in the line.
_START = (r"(?:\d{1,3},\d{1,20},\d{1,20},[^;]{0,40};"
          r"|\[[^\]\n]{1,40}\] ?"
          r"|(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT[\d:.+-]{8,32})"
          r" [^ ]{1,253} kernel: (?:\[[^\]\n]{1,40}\] ?)?)?")
_XID = re.compile(_START + r"NVRM: Xid \(" + _PCI + r"\): (\d{1,5})\b,?\s*(.*)")
_SXID = re.compile(_START + r"(nvidia-nvswitch\d{0,3}): SXid \(" + _PCI +
                   r"\): (\d{1,5})\b,?\s*(.*)")
PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_VENDOR = "0x10de"


@dataclass(frozen=True)
class KmsgXid:
    """One Xid (or NVSwitch SXid) line."""

    pci: tuple[int, int, int]  # (domain, bus, device)
    xid: int
    detail: str
    sxid: bool = False
    switch: str = ""  # nvidia-nvswitchN for an SXid


def pci_key(bus_id: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of ``0000:3b:00``, ``00000000:3B:00.0``, ``PCI:0000:3b:00``."""
    m = re.fullmatch(_PCI, bus_id.strip())
    if m is None:
        return None
    return int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16)


def parse_line(line: str) -> KmsgXid | None:
    """The Xid or SXid in one kernel log line, else None (cheap for every other line)."""
    if "Xid" not in line:
        return None
    text = line[:MAX_LINE]
    m = _XID.match(text)
    if m is not None:
        pci = (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16))
        return KmsgXid(pci, int(m.group(5)), m.group(6).strip())
    m = _SXID.match(text)
    if m is not None:
        pci = (int(m.group(2), 16), int(m.group(3), 16), int(m.group(4), 16))
        return KmsgXid(pci, int(m.group(6)), m.group(7).strip(), sxid=True,
                       switch=m.group(1))
    return None


def _message(record: bytes) -> str:
    """The message of a /dev/kmsg record (``PRI,SEQ,TS,FLAGS[,...];MESSAGE\\n KEY=V...``)."""
    head, sep, rest = record.partition(b";")
    body = rest if sep and b"," in head else record
    return body.split(b"\n", 1)[0].decode("utf-8", "replace")


def from_kernel(record: bytes) -> bool:
    """Whether a /dev/kmsg record was logged by the kernel: its PRI is facility * 8 +
    level, and the kernel's facility is 0; a record written into /dev/kmsg from user
    space has facility 1 (LOG_USER) or more, whatever its text says."""
    pri = record.split(b",", 1)[0]
    return pri.isdigit() and len(pri) <= 4 and int(pri) < 8


def nvidia_pci_device(pci: tuple[int, int, int], root: str = PCI_DEVICES) -> bool:
    """Whether this host has an NVIDIA PCI device (a GPU, an NVSwitch) at ``pci``
    (domain, bus, device; any function), from sysfs: an SXid naming a device that is not
    here is not about this node."""
    prefix = f"{pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}."
    try:
        names = [n for n in os.listdir(root) if n.lower().startswith(prefix)]
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(root, name, "vendor")) as f:
                if f.read(16).strip().lower() == NVIDIA_VENDOR:
                    return True
        except OSError:
            continue
    return False


class KmsgReader:
    """Reads kernel log lines from ``path`` in its own thread; ``on_line(ts, text)``."""

    def __init__(self, path: str = KMSG, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.path = path
        self.clock = clock
        self.lines = 0
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._kind = ""

    def open(self) -> None:
        """Open now (errors are the caller's: unreadable means no kernel-log Xids)."""
        # a FIFO opened for writing too never reads as ended when its writers come and go
        access = os.O_RDWR if stat.S_ISFIFO(os.stat(self.path).st_mode) else os.O_RDONLY
        fd = os.open(self.path, access | os.O_NONBLOCK | os.O_CLOEXEC)
        mode = os.fstat(fd).st_mode
        if stat.S_ISCHR(mode):
            self._kind = "device"
            os.lseek(fd, 0, os.SEEK_END)  # only records from now on
        elif stat.S_ISFIFO(mode):
            self._kind = "fifo"
        else:
            self._kind = "file"
        self._fd = fd

    def start(self, on_line: Callable[[float, str], None]) -> None:
        if self._fd < 0:
            self.open()
        self._thread = threading.Thread(target=self._run, args=(on_line,),
                                        name="ftagent-kmsg", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout)
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._fd = self._wake_r = self._wake_w = -1

    def _run(self, on_line: Callable[[float, str], None]) -> None:
        try:
            if self._kind == "device":
                self._records(on_line)
            else:
                self._stream(on_line)
        except Exception:
            log.exception("reading %s failed; kernel-log Xids are off", self.path)

    def _wait(self) -> bool:
        """Block until the log is readable (a file: a while); False when stopping."""
        if self._kind == "file":
            return not self._stop.wait(FILE_POLL)
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        p.register(self._wake_r, select.POLLIN)
        p.poll()
        return not self._stop.is_set()

    def _records(self, on_line: Callable[[float, str], None]) -> None:
        while not self._stop.is_set():
            try:
                record = os.read(self._fd, RECORD)
            except BlockingIOError:
                if not self._wait():
                    return
                continue
            except OSError as e:
                if e.errno == errno.EPIPE:  # records overwritten before we read them
                    continue
                raise
            self.lines += 1
            if from_kernel(record):
                on_line(self.clock(), _message(record))

    def _stream(self, on_line: Callable[[float, str], None]) -> None:
        pending = b""
        while not self._stop.is_set():
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                chunk = b""
            if not chunk:  # nothing yet (a FIFO), or the end of a file so far
                if not self._wait():
                    return
                continue
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()[-MAX_LINE:]
            ts = self.clock()
            for raw in lines:
                self.lines += 1
                on_line(ts, raw.decode("utf-8", "replace"))
