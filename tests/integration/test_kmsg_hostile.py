"""Kernel-log lines anyone can make the kernel print do not raise GPU faults (issue 20).

The real GPU source (simulated NVML, the kernel log from a FIFO as from /dev/kmsg's
reader) and the real detector: a quoted Xid and an SXid of an NVSwitch this host does not
have (no NVIDIA device in this machine's sysfs) are never faults.
"""

from __future__ import annotations

import os
from pathlib import Path

from ftagent.model import SXID_UNKNOWN_DEVICE
from ftagent.sources import kmsg
from tests.conftest import until
from tests.integration.test_gpu_source import aio, running


@aio
async def test_quoted_xids_and_foreign_sxids_raise_no_fault(tmp_path: Path) -> None:
    assert not kmsg.nvidia_pci_device((0, 0x83, 0))  # this machine has no NVSwitch there
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    async with running(tmp_path, "gpus 1\n", kmsg=str(fifo)) as run:
        fd = os.open(fifo, os.O_WRONLY)
        try:
            os.write(fd, b"[ 9.1] tmpfs: Unknown parameter 'NVRM: Xid (PCI:0000:18:00): 79'\n"
                         b"[ 9.2] nvidia-nvswitch0: SXid (PCI:0000:83:00.0): 20034, Fatal, "
                         b"Link 30 LTSSM Fault Up\n"
                         b"[ 9.3] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=x, SM\n")
            await until(lambda: run.events("xid") and run.events("sxid"), 5,
                        "the real Xid and the SXid")
        finally:
            os.close(fd)
        assert [(e.xid, e.source) for e in run.events("sxid")] == [(20034, SXID_UNKNOWN_DEVICE)]
        assert [e.xid for e in run.events("xid")] == [13]  # not 79: it was quoted
        assert len(run.faults) == 1 and "Xid 13" in run.faults[0].message, run.faults
