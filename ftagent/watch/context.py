"""What a watch part's factory gets: the settings and the process it runs in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ftagent.config import GpuConfig, NicConfig


@dataclass(frozen=True)
class WatchContext:
    """The settings a factory reads (``--gpu-*``, ``--nic*``) and where it runs.

    ``environ``: this process's environment (which accelerator the machine has).
    ``trainer_environ``: the trainer's (its visible devices, ``NCCL_SOCKET_IFNAME``,
    ``NCCL_IB_HCA``); empty on the node agent, which watches every device the host shows
    and the links ``--nic`` names. ``rank``: the simulated timelines' rank. ``netns``:
    watch the links of that network namespace. ``hide`` / ``show``: the vendor tools'
    processes are kept out of the trainer's tree (``sources/vendor_tool.Tool``).
    """

    gpu: GpuConfig = field(default_factory=GpuConfig)
    nic: NicConfig = field(default_factory=NicConfig)
    environ: Mapping[str, str] = field(default_factory=dict)
    trainer_environ: Mapping[str, str] = field(default_factory=dict)
    rank: int = 0
    netns: str | None = None
    hide: Callable[[int], None] | None = None
    show: Callable[[int], None] | None = None
