"""The autotune log: Horovod's CSV (``HOROVOD_AUTOTUNE_LOG``), one row per scored sample and a
last row with the best setting, written by rank 0; and the ``Autotuner:`` lines of hvdlite's
log."""
from __future__ import annotations

import logging

from hvdlite.common.tuning.parameter_space import LOG_COLUMNS, Setting

log = logging.getLogger("hvdlite")


class TuningLog:
    """Writes the CSV at ``path`` (None: no file) and the log lines."""

    def __init__(self, path: str | None) -> None:
        self._file = None
        if path:
            self._file = open(path, "w", encoding="utf-8")
            self._write(list(LOG_COLUMNS))
        log.info("Autotuner: Tunable params [%s] score", ",".join(LOG_COLUMNS[:-1]))

    def _write(self, fields: list[str]) -> None:
        if self._file is not None:
            self._file.write(",".join(fields) + "\n")
            self._file.flush()   # readable while the job runs, and after a kill

    def sample(self, setting: Setting, score: float) -> None:
        """A scored sample (score: bytes per microsecond, as Horovod's)."""
        log.info("Autotuner: [%s] %g", ", ".join(setting.log_row(score)[:-1]), score)
        self._write(setting.log_row(score))

    def warming_up(self, remaining: int) -> None:
        log.info("Autotuner: Warming up (%d remaining)", remaining)

    def best(self, setting: Setting, score: float) -> None:
        log.info("Autotuner: Best params [%s] %g", ", ".join(setting.log_row(score)[:-1]),
                 score)
        self._write(setting.log_row(score))
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
