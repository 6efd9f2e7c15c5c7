"""CUDA through CuPy: the runtime probes and device primitives, and completing GPU work."""
