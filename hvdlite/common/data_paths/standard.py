"""The data paths an engine asks, in order, which one serves a batch.  Adding a path: write
its class (a :class:`~hvdlite.common.engine.data_path.DataPath`) and put it in this list where it
should be preferred."""
from __future__ import annotations

from hvdlite.common.data_paths.adasum import AdasumPath
from hvdlite.common.data_paths.hierarchical import HierarchicalPath
from hvdlite.common.data_paths.mpi import MPIPath
from hvdlite.common.data_paths.nccl import NCCLPath
from hvdlite.common.data_paths.staged import StagedPath
from hvdlite.common.data_paths.within_node import DirectCopyPath, SharedWindowPath
from hvdlite.common.engine.data_path import DataPath, PathContext

# GPU batches: NCCL where it can, else through host memory.  Host batches: the intra-node
# paths first (direct copies for one large tensor, then the shared-memory window; sets within
# one host), Adasum, the hierarchical path (sets spanning hosts), and MPI, which serves
# everything.
PATHS: list[type[DataPath]] = [NCCLPath, StagedPath, DirectCopyPath, SharedWindowPath,
                               AdasumPath, HierarchicalPath, MPIPath]


def standard_paths(context: PathContext) -> list[DataPath]:
    """One instance of every registered path, in order, for one engine."""
    return [cls(context) for cls in PATHS]
