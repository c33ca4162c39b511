"""PyInstaller runtime hook: give the environment back as it was before the bootloader
changed it, so that the trainer (every process the agent starts) sees exactly the
``LD_LIBRARY_PATH`` it would have seen without ftagent, and no ``_PYI_*`` variables.

The bootloader prepends the bundle's library folder to ``LD_LIBRARY_PATH`` and keeps the
original in ``LD_LIBRARY_PATH_ORIG`` when there was one (PyInstaller's "Launching external
programs from the frozen application"). The running agent keeps what it loaded: the
dynamic loader read the variable when this process started. ``PATH`` and ``PYTHONPATH``
the bootloader leaves alone, and are passed on as they are.
"""

import os
import sys

_bundle = getattr(sys, "_MEIPASS", "")
for _var in ("LD_LIBRARY_PATH",):
    _orig = os.environ.pop(_var + "_ORIG", None)
    if _orig is not None:
        os.environ[_var] = _orig
    elif _var in os.environ and _bundle:
        _kept = [p for p in os.environ[_var].split(os.pathsep)
                 if p and not os.path.realpath(p).startswith(os.path.realpath(_bundle))]
        if _kept:
            os.environ[_var] = os.pathsep.join(_kept)
        else:
            del os.environ[_var]
for _var in [v for v in os.environ if v.startswith("_PYI_") or v == "_MEIPASS2"]:
    del os.environ[_var]
