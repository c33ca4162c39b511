"""``ftagent node``: the host agent (a DaemonSet, one per GPU node).

It runs the pod agent's watch loop (``ftagent/watch/``: every registered part, today the
GPUs and the links) for the whole host and sends what its detectors conclude three ways::

    GpuSource (NVML, /dev/kmsg) --> GpuDetector --+--> NodeReporter --ReportNode--> every arbiter
    NicSource (netlink), Rdma   --> NicDetector --+      shard (wire), re-sent until acked
                                                  +--> NodeConditions --> Node status
                                                  |      (FtagentGPUHealthy, FtagentNICHealthy)
                                                  +--> /metrics (GPU/NIC series, label node)

The arbiter applies each node fault to every job with ranks on the node (the agents'
``Hello.node``), a GPU's only to the ranks whose pods hold it (``Hello.gpus``).
Modules: ``cmd/node.py`` (flags, composition), ``agent`` (the watch loop's sinks and the
conditions' tick), ``reports`` (the arbiter side), ``conditions`` (the Kubernetes side).
Nothing here imports the arbiter; like the pod agent it stands on ``wire/``,
``model.py``, ``config.py`` and ``watch/``.
"""
