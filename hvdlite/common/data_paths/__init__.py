"""The data paths: one interface, and a class per way of moving a batch (MPI, window, direct
copies, NCCL, staged, Adasum, hierarchical)."""
