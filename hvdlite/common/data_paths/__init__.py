"""The data paths: a class per way of moving a batch (MPI, window, direct copies, NCCL, staged,
Adasum, hierarchical), the helpers they share, and the registry; the interface they implement
is hvdlite.common.engine.data_path."""
