"""The command-line entry points: one module per ``ftagent`` subcommand that wires rooms.

``run`` (the pod agent), ``arbiter``, ``status``, ``token``, ``node`` (the host agent) and
``webhook``: each has ``main(argv) -> int`` and holds flags and composition only -- what
the room does stays in the room. This is the top layer: the only place that may import
every room (``cmd -> kube -> arbiter`` all point down), and nothing below imports it
(tests/unit/test_layers.py checks both). ``ftagent/cli.py`` dispatches here.
"""
