"""Moving data between the ranks of one node: a shared-memory window, direct copies (CMA)."""
