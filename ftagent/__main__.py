"""``python -m ftagent`` is the ``ftagent`` command."""

from ftagent.cli import main

raise SystemExit(main())
