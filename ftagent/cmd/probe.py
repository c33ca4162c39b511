"""Can ``ftagent run`` start here? The injected entry shim's probe (not a user command).

The shim (packaging/ftagent-entry.sh) asks this before it hands the trainer to the agent,
through the bundle (packaging/entry.py) or the image's Python (packaging/launch.py): every
module ``ftagent run`` imports loads (a missing shared library, a glibc too old, a broken
interpreter fail here), the flags' environment parses (a training image's malformed
``FTAGENT_*`` value would make ``ftagent run`` exit 2 before the trainer starts), and a
private runtime folder can be made (a read-only root with no writable ``TMPDIR``). When any
of these fails, the shim starts the trainer without the agent and says why in one line.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Mapping


def why_not(environ: Mapping[str, str]) -> str:
    """"" when ``ftagent run`` can start in this environment, else why not (one line)."""
    try:
        from ftagent.cmd import run  # everything `ftagent run` needs, loaded
        from ftagent.config import ConfigError
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return f"cannot load the agent: {type(e).__name__}: {e}"
    try:
        cfg = run.parse(["--", "true"], environ)
    except ConfigError as e:
        return f"ftagent run: error: {e}"
    if cfg.identity.spare and (cfg.launch.nproc_per_node or not cfg.arbiter.arbiter):
        return "ftagent run: error: --spare needs an arbiter and a single worker"
    try:
        folder = tempfile.mkdtemp(prefix="ftagent-probe-")
    except OSError as e:
        return f"no writable temporary folder (TMPDIR, /tmp): {e}"
    shutil.rmtree(folder, ignore_errors=True)
    return ""


def main() -> int:
    """Prints the version and exits 0, or prints why not (one line) and exits 3."""
    why = why_not(os.environ)
    if why:
        print(" ".join(why.split())[:300], flush=True)
        return 3
    from ftagent import __version__

    print(f"ftagent {__version__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
