"""Autotune: Horovod's run-time tuner of the engine's settings (fusion threshold, cycle time,
response cache, hierarchical allreduce/allgather), decided on rank 0 and applied by the engine
on every rank at the same round boundary (see docs/autotune.md)."""
