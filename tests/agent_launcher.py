"""The agent as the tests' own interpreter runs it, wherever that interpreter lives.

``ftagent_launcher(path)`` writes an executable that runs the bundle's entry point
(packaging/entry.py: ``ftagent``, and the entry shim's probe) with ``sys.executable`` and
this checkout's package first on its path, without depending on a console script installed
in a ``.venv`` or on ``PATH``. No environment variable is
set, so the trainer it wraps sees exactly the environment the test gave.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.conftest import ROOT

_SCRIPT = """#!{python}
import runpy, sys
sys.path.insert(0, {root!r})
runpy.run_path({entry!r}, run_name="__main__")
"""


def ftagent_launcher(path: Path) -> Path:
    """An executable ``ftagent`` at ``path`` (its folder is made if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_SCRIPT.format(python=sys.executable, root=str(ROOT),
                                    entry=str(ROOT / "packaging" / "entry.py")))
    path.chmod(0o755)
    return path
