"""Everything that speaks Kubernetes: the admission webhook that injects the agent into
training pods (``webhook``: the HTTPS edge; ``inject``: the pure pod mutation; ``identity``:
who a pod is from its job's labels and environment; ``certs``: serving certificates).

Nothing here is imported by the agent: ``ftagent run`` stays free of Kubernetes code.
"""
