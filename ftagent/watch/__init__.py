"""One sources -> detectors -> sinks loop for the pod agent, the node agent and gpu-check.

``registry.FACTORIES`` names the parts (GPUs, links), ``loop.WatchLoop`` runs them, the
command that wires the process chooses the sinks. See docs/architecture.md, "Sources,
detectors, sinks".
"""
