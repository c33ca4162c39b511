"""Which GPUs the trainer may use, from the variables CUDA and the container runtime read.

Pure: ``select_gpus(environ, devices, mig_parent)`` maps them onto the GPUs NVML shows
(``devices``, in NVML's order, which is PCI bus order).

1. ``NVIDIA_VISIBLE_DEVICES`` (the NVIDIA container runtime; the device plugin sets it):
   unset, empty or ``all`` -- every GPU NVML shows; ``none`` / ``void`` -- none; UUIDs
   (``GPU-...``, ``MIG-...``) -- those GPUs; indices -- host indices: inside a container
   NVML already shows only those (renumbered from 0), so they filter only when NVML shows
   more GPUs than listed (a privileged pod, or no container at all).
2. ``CUDA_VISIBLE_DEVICES`` on top, as CUDA parses it: unset -- all of step 1; empty -- none;
   otherwise a comma-separated list of indices into step 1's GPUs, ``GPU-<uuid>`` (a
   unique prefix is enough) or ``MIG-<uuid>`` (the MIG device's GPU), read up to the first
   entry that is not valid (``-1`` hides every GPU after it, as in CUDA). Indices assume
   CUDA's order is the PCI bus order, which holds with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and
   on nodes of identical GPUs (CUDA breaks its "fastest first" ties by bus id).

A MIG device's faults are its GPU's (NVML raises Xids on the GPU); ``GpuDevice.mig``
keeps which MIG devices of it the trainer uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from ftagent.model import GpuDevice


def _mig_of(devices: Sequence[GpuDevice], mig_parent: Mapping[str, int], token: str
            ) -> GpuDevice | None:
    parent = mig_parent.get(token)
    return next((d for d in devices if d.index == parent), None)


def _by_uuid(devices: Sequence[GpuDevice], token: str) -> GpuDevice | None:
    hits = [d for d in devices if d.uuid.lower().startswith(token.lower())]
    return hits[0] if len(hits) == 1 else None


def _add(chosen: dict[int, GpuDevice], dev: GpuDevice, mig: str | None) -> None:
    have = chosen.get(dev.index, replace(dev, mig=()))
    if mig is not None and mig not in have.mig:
        have = replace(have, mig=have.mig + (mig,))
    chosen[dev.index] = have


def _runtime(environ: Mapping[str, str], devices: Sequence[GpuDevice],
             mig_parent: Mapping[str, int]) -> tuple[list[GpuDevice], str]:
    raw = environ.get("NVIDIA_VISIBLE_DEVICES")
    if raw is None or raw.strip() in ("", "all"):
        return list(devices), ""
    value = raw.strip()
    why = f"NVIDIA_VISIBLE_DEVICES={value}"
    if value in ("none", "void"):
        return [], why
    tokens = [t.strip() for t in value.split(",") if t.strip()]
    if all(t.isdigit() for t in tokens):
        if len(devices) <= len(tokens):  # the runtime mounted just these: NVML renumbered
            return list(devices), why
        wanted = {int(t) for t in tokens}
        return [d for d in devices if d.index in wanted], why
    chosen: dict[int, GpuDevice] = {}
    for t in tokens:
        if t.startswith("MIG-"):
            dev = _mig_of(devices, mig_parent, t)
            if dev is not None:
                _add(chosen, dev, t)
        else:
            dev = _by_uuid(devices, t)
            if dev is not None:
                _add(chosen, dev, None)
    return sorted(chosen.values(), key=lambda d: d.index), why


def select_gpus(environ: Mapping[str, str], devices: Sequence[GpuDevice],
                mig_parent: Mapping[str, int] | None = None) -> tuple[list[GpuDevice], str]:
    """(the GPUs the trainer may use, why: for the start-up log line). See the module doc."""
    migs = mig_parent or {}
    base, why = _runtime(environ, devices, migs)
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return base, why or "every GPU NVML shows"
    why = ", ".join(w for w in (why, f"CUDA_VISIBLE_DEVICES={raw.strip()}") if w)
    chosen: dict[int, GpuDevice] = {}
    for token in (t.strip() for t in raw.split(",")):
        if token.isdigit() and int(token) < len(base):
            _add(chosen, base[int(token)], None)
        elif token.startswith("MIG-") and (dev := _mig_of(base, migs, token)) is not None:
            _add(chosen, dev, token)
        elif token.startswith("GPU-") and (dev := _by_uuid(base, token)) is not None:
            _add(chosen, dev, None)
        else:
            break  # CUDA stops at the first entry it cannot use
    return list(chosen.values()), why
