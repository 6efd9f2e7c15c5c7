"""Helpers for worker scripts: run named cases, record pass/fail per rank as JSON."""
from __future__ import annotations

import json
import os
import traceback


class Reporter:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.results: dict[str, str | None] = {}

    def case(self, name: str, fn, *args, **kwargs) -> None:
        """Run ``fn``; an exception (including AssertionError) marks the case failed."""
        try:
            fn(*args, **kwargs)
            self.results[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is the test report
            self.results[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"

    def write(self) -> None:
        out = os.environ["HVDLITE_TEST_OUT"]
        with open(os.path.join(out, f"rank{self.rank}.json"), "w") as f:
            json.dump(self.results, f)
