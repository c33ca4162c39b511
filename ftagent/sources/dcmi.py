"""Ascend's DCMI library (``libdcmi.so``) through ctypes: health and error codes per chip
without a process per call.

Bound functions, as Huawei's DCMI API reference documents them (hiascend.com, Atlas 200I
A2 editions 23.0.0 to 25.5.0, "设备管理接口"):

* ``int dcmi_init(void)``;
* ``int dcmi_get_device_health(int card_id, int device_id, unsigned int *health)``:
  0 normal, 1 minor (一般告警), 2 major (重要告警), 3 critical (紧急告警),
  0xFFFFFFFF the device does not exist;
* ``int dcmi_get_device_errorcode_v2(int card_id, int device_id, int *error_count,
  unsigned int *error_code_list, unsigned int list_len)``: up to 128 codes.

``card_id`` is the NPU ID npu-smi shows, ``device_id`` the chip in it (0 on single-chip
cards). A non-zero return is an error of that call (the library's return codes; -8005
and friends: the driver is not ready) and gives no sample; the library missing or
``dcmi_init`` failing leaves the backend on ``npu-smi -t health``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

log = logging.getLogger("ftagent.sources.dcmi")

DEFAULT_PATHS = ("libdcmi.so", "/usr/local/dcmi/libdcmi.so")
MAX_CODES = 128
NOT_EXIST = 0xFFFFFFFF
HEALTH = {0: "ok", 1: "warning", 2: "alarm", 3: "critical"}


class DcmiError(Exception):
    """A DCMI call returned non-zero."""


class Dcmi:
    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib = lib
        self.path = path
        self._health = lib.dcmi_get_device_health
        self._health.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint)]
        self._health.restype = ctypes.c_int
        self._codes = lib.dcmi_get_device_errorcode_v2
        self._codes.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                ctypes.POINTER(ctypes.c_uint), ctypes.c_uint]
        self._codes.restype = ctypes.c_int

    @classmethod
    def load(cls, paths: Sequence[str] = DEFAULT_PATHS) -> tuple[Dcmi | None, str]:
        """(the library, initialised) or (None, why not)."""
        why = []
        for path in paths:
            try:
                lib = ctypes.CDLL(path)
                init = lib.dcmi_init
                init.restype = ctypes.c_int
                rc = init()
                if rc != 0:
                    why.append(f"{path}: dcmi_init returned {rc}")
                    continue
                return cls(lib, path), ""
            except (OSError, AttributeError) as e:
                why.append(f"{path}: {e}")
        return None, "; ".join(why)

    def health(self, card: int, chip: int = 0) -> str:
        """ok | warning | alarm | critical | gone (the device does not exist)."""
        value = ctypes.c_uint(0)
        rc = self._health(card, chip, ctypes.byref(value))
        if rc != 0:
            raise DcmiError(f"dcmi_get_device_health({card}, {chip}) returned {rc}")
        if value.value == NOT_EXIST:
            return "gone"
        return HEALTH.get(value.value, "critical")

    def codes(self, card: int, chip: int = 0) -> tuple[int, ...]:
        count = ctypes.c_int(0)
        buf = (ctypes.c_uint * MAX_CODES)()
        rc = self._codes(card, chip, ctypes.byref(count), buf, MAX_CODES)
        if rc != 0:
            raise DcmiError(f"dcmi_get_device_errorcode_v2({card}, {chip}) returned {rc}")
        n = max(0, min(count.value, MAX_CODES))
        return tuple(int(buf[i]) for i in range(n) if buf[i])
