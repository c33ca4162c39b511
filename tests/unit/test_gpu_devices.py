"""Which GPUs the trainer may use (sources/gpu_devices.py): indices, UUIDs, MIG ids, none."""

from __future__ import annotations

import pytest

from ftagent.model import GpuDevice
from ftagent.sources.gpu_devices import select_gpus

GPUS = [GpuDevice(i, f"GPU-{i}{i}{i}{i}aaaa-0000-4000-8000-00000000000{i}",
                  f"00000000:{0x18 + i:02X}:00.0", "NVIDIA H100 80GB HBM3") for i in range(4)]
MIG = {"MIG-1111-a": 1, "MIG-1111-b": 1, "MIG-3333-a": 3}


def pick(env: dict[str, str], devices: list[GpuDevice] = GPUS) -> list[int]:
    return [d.index for d in select_gpus(env, devices, MIG)[0]]


@pytest.mark.parametrize(("env", "indices"), [
    ({}, [0, 1, 2, 3]),
    ({"CUDA_VISIBLE_DEVICES": "2,0"}, [2, 0]),  # CUDA's order
    ({"CUDA_VISIBLE_DEVICES": ""}, []),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, []),
    ({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, [1]),  # CUDA stops at the first invalid entry
    ({"CUDA_VISIBLE_DEVICES": "1,7,2"}, [1]),
    ({"CUDA_VISIBLE_DEVICES": "GPU-2222"}, [2]),  # a unique UUID prefix
    ({"CUDA_VISIBLE_DEVICES": "GPU-,1"}, []),  # ambiguous prefix: invalid, stop
    ({"CUDA_VISIBLE_DEVICES": "MIG-3333-a"}, [3]),
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, [0, 1, 2, 3]),
    ({"NVIDIA_VISIBLE_DEVICES": "none"}, []),
    ({"NVIDIA_VISIBLE_DEVICES": "void"}, []),
    ({"NVIDIA_VISIBLE_DEVICES": "GPU-1111aaaa-0000-4000-8000-000000000001,GPU-3333"}, [1, 3]),
    ({"NVIDIA_VISIBLE_DEVICES": "1,3"}, [1, 3]),  # NVML shows more: a privileged pod
    ({"NVIDIA_VISIBLE_DEVICES": "MIG-1111-b", "CUDA_VISIBLE_DEVICES": "0"}, [1]),
    ({"NVIDIA_VISIBLE_DEVICES": "GPU-1111,GPU-3333", "CUDA_VISIBLE_DEVICES": "1"}, [3]),
])
def test_visible_devices(env: dict[str, str], indices: list[int]) -> None:
    assert pick(env) == indices


def test_indices_inside_a_container_are_renumbered_by_the_runtime() -> None:
    # the runtime mounted host GPUs 5 and 6: NVML inside shows two GPUs, 0 and 1
    assert pick({"NVIDIA_VISIBLE_DEVICES": "5,6"}, GPUS[:2]) == [0, 1]


def test_mig_devices_are_kept_on_their_gpu() -> None:
    chosen, why = select_gpus({"CUDA_VISIBLE_DEVICES": "MIG-1111-a,MIG-1111-b"}, GPUS, MIG)
    assert [(d.index, d.mig) for d in chosen] == [(1, ("MIG-1111-a", "MIG-1111-b"))]
    assert why == "CUDA_VISIBLE_DEVICES=MIG-1111-a,MIG-1111-b"
    assert select_gpus({}, GPUS)[1] == "every GPU NVML shows"
