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
        """Write the report whole or not at all: a rank killed while writing (the launcher
        tears a failed job down) must not leave a truncated file behind."""
        out = os.environ["HVDLITE_TEST_OUT"]
        path = os.path.join(out, f"rank{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.results, f)
        os.replace(path + ".tmp", path)


def always(size: int) -> bool:
    return True


def pow2(size: int) -> bool:
    return size & (size - 1) == 0


class CaseRegistry:
    """A worker's named cases, each run only at the job sizes its ``when(size)`` accepts.

    The test file parametrises over ``names_for(size)`` and the worker runs the same list, so
    a case that never reports shows up as a missing result, not as silence."""

    def __init__(self) -> None:
        self._cases: dict[str, tuple] = {}   # name -> (function, which sizes run it)

    def register(self, name: str, fn, when=always) -> None:
        assert name not in self._cases, name
        self._cases[name] = (fn, when)

    def case(self, name: str, when=always):
        """Decorator form of :meth:`register`."""
        def deco(fn):
            self.register(name, fn, when)
            return fn
        return deco

    def names_for(self, size: int) -> list[str]:
        return [name for name, (_, when) in self._cases.items() if when(size)]

    def function(self, name: str):
        return self._cases[name][0]
