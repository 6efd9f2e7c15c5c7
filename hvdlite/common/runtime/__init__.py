"""The process's hvdlite state: init/shutdown, topology, process sets, liveness, watchdog,
timeline."""
