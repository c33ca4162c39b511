"""The lab: simulated nodes (network namespaces on bridges) running one real job each
drill; see lab.py. Reused by bench/goodput.py."""

from tests.lab.lab import FAST_ENV, Lab, line_of, wait

__all__ = ["FAST_ENV", "Lab", "line_of", "wait"]
