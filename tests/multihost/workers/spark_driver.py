"""A Spark driver for tests/multihost/test_spark.py, run inside a simulated host: connects to
the bed's standalone Spark cluster and runs one hvdlite.spark job, then prints
``RESULT <json>``.

argv: mode (``run``, ``late_exit`` or ``elastic``), the master's URL, this host's address,
and a directory every host sees (the jobs' logs and results).
"""
from __future__ import annotations

import json
import os
import sys

from tests.multihost.workers.ray_driver import collectives


def late_exit() -> dict:
    """``collectives`` on every rank, then the last rank is 2 s late to end (its exit, and so
    its MPI_Finalize, comes after the other ranks' processes are gone)."""
    import atexit
    import time

    import hvdlite as hvd
    result = collectives()
    if hvd.rank() == hvd.size() - 1:
        atexit.register(time.sleep, 2.0)   # after init: runs before hvdlite's own exit
    return result


def main() -> None:
    mode, master, address, out = sys.argv[1:5]
    from pyspark.sql import SparkSession

    import hvdlite.spark
    from tests.ray import elastic_funcs
    builder = (SparkSession.builder.master(master).appName(f"hvdlite-multihost-{mode}")
               .config("spark.driver.host", address)
               .config("spark.driver.bindAddress", address)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.pyspark.python", sys.executable)
               .config("spark.executor.memory", "1g")
               .config("spark.cores.max", "4"))
    for name in ("MPIR_CVAR_CH4_NETMOD", "FI_PROVIDER", "FI_TCP_IFACE", "PYTHONPATH",
                 "OMP_NUM_THREADS"):
        builder = builder.config(f"spark.executorEnv.{name}", os.environ[name])
    spark = builder.getOrCreate()
    try:
        if mode in ("run", "late_exit"):
            result = hvdlite.spark.run(collectives if mode == "run" else late_exit, num_proc=4,
                                       start_timeout=120)
        elif mode == "elastic":
            result = hvdlite.spark.run_elastic(elastic_funcs.train, args=[{
                "out": out, "steps": 100000, "until_file": os.path.join(out, "stop"),
                "sleep": 0.1}], num_proc=4, min_num_proc=2, max_num_proc=4,
                start_timeout=120, elastic_timeout=120)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        spark.stop()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
