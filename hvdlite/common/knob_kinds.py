"""The building blocks of the knob table (:data:`hvdlite.common.config.KNOBS`): how a variable's
text becomes a value (the kinds), and how an ``hvdlite run`` flag exports a knob.

Like config.py, this module imports only the standard library: the docs build loads both on
their own (``scripts/mkdocs_knobs.py``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Callable, Union

if TYPE_CHECKING:
    from hvdlite.common.config import Knob

_ON_WORDS = ("1", "true", "yes", "on")
_OFF_WORDS = ("0", "false", "no", "off")


# --- how a variable's text becomes a value ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Number:
    """A non-negative number.  ``cast=int`` reads it as Horovod does (``1e3`` is 1000, a
    fraction is cut); ``scale`` turns the variable's unit into the field's (``MIB`` for the
    ``*_MB`` knobs, whose fields are bytes)."""

    cast: type = float
    scale: int | None = None

    @property
    def type_name(self) -> str:
        return "integer" if self.cast is int else "number"

    def parse(self, variable: str, raw: str, knob: "Knob"):
        try:
            number = float(raw)
            if not math.isfinite(number):   # nan, inf: no setting means that
                raise ValueError
            value = self.cast(number) if self.cast is int else self.cast(raw)
        except (ValueError, OverflowError):
            raise ValueError(f"{variable}={raw!r} is not a finite number.") from None
        if value < 0:
            raise ValueError(f"{variable}={raw!r} must not be negative.")
        return self.to_field(value)

    def to_field(self, value):
        return value if self.scale is None else int(value * self.scale)


def _on_off(variable: str, raw: str, choices: str, help_text: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case); other integers as Horovod reads them (on if
    positive).  Anything else is an error naming the variable: a typo must not silently pick a
    behaviour."""
    word = raw.lower()
    if word in _ON_WORDS:
        return True
    if word in _OFF_WORDS:
        return False
    try:
        return int(word) > 0
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not understood; use {choices} "
                         f"({help_text}).") from None


@dataclasses.dataclass(frozen=True)
class Switch:
    """An on/off knob; ``invert``: the field is its opposite (``STALL_CHECK_DISABLE`` feeds
    ``stall_check_enabled``)."""

    invert: bool = False
    type_name = "on/off"

    def parse(self, variable: str, raw: str, knob: "Knob") -> bool:
        return self.to_field(_on_off(variable, raw, "1 or 0", knob.help))

    def to_field(self, value: bool) -> bool:
        return value is not self.invert


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of a few words (any case)."""

    values: tuple[str, ...]

    @property
    def type_name(self) -> str:
        return " / ".join(self.values)

    def parse(self, variable: str, raw: str, knob: "Knob") -> str:
        value = raw.lower()
        if value not in self.values:
            raise ValueError(f"{variable}={raw!r} is not one of {', '.join(self.values)} "
                             f"({knob.help}).")
        return value

    def to_field(self, value: str) -> str:
        return value


@dataclasses.dataclass(frozen=True)
class LogLevel:
    """A log level by name, any case: Python's, plus Horovod's ``trace`` (read as DEBUG) and
    ``fatal`` (CRITICAL).  Checked here, so that a typo fails ``init()`` on every rank rather
    than later on one."""

    type_name = "level name"
    names = ("trace", "debug", "info", "warning", "error", "fatal", "critical")

    def parse(self, variable: str, raw: str, knob: "Knob") -> str:
        level = raw.lower()
        if level not in self.names:
            raise ValueError(f"{variable}={raw!r} is not a log level; use one of "
                             f"{', '.join(self.names)}.")
        return {"trace": "DEBUG", "fatal": "CRITICAL"}.get(level, level).upper()

    def to_field(self, value: str) -> str:
        return value


@dataclasses.dataclass(frozen=True)
class AutoSwitch:
    """``auto``, or an on/off word: the field is ``"auto"``, ``"on"`` or ``"off"``."""

    type_name = "auto / on/off"

    def parse(self, variable: str, raw: str, knob: "Knob") -> str:
        if raw.lower() == "auto":
            return "auto"
        return "on" if _on_off(variable, raw, "auto, 1 or 0", knob.help) else "off"

    def to_field(self, value: str) -> str:
        return value


@dataclasses.dataclass(frozen=True)
class Text:
    """Free text; ``upper`` upper-cases it, ``type_name`` says what it is (for the docs)."""

    type_name: str = "text"
    upper: bool = False

    def parse(self, variable: str, raw: str, knob: "Knob") -> str:
        return raw.upper() if self.upper else raw

    def to_field(self, value):
        return value


Kind = Union[Number, Switch, Choice, AutoSwitch, Text, LogLevel]


# --- hvdlite run's flags ------------------------------------------------------------------------
def _as_given(value) -> str:
    if isinstance(value, str):
        return value
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclasses.dataclass(frozen=True)
class Conversion:
    """How a flag's value becomes the variable's text; ``text`` describes it in ``--help`` and
    the docs (empty: the value as given)."""

    text: str
    apply: Callable[[object], str]


AS_GIVEN = Conversion("", _as_given)
MB_TO_BYTES = Conversion("MB × 1024 × 1024", lambda mb: str(int(round(mb * 1024 * 1024))))
# absolute: every rank resolves it alike, whatever its working directory
ABSOLUTE = Conversion("the absolute path", os.path.abspath)
LOG_LEVEL_NAME = Conversion(
    "LEVEL in capitals, trace as DEBUG and fatal as CRITICAL",   # Python's logging has neither
    lambda level: {"trace": "DEBUG", "fatal": "CRITICAL"}.get(level, level).upper())


@dataclasses.dataclass(frozen=True)
class Flag:
    """An ``hvdlite run`` flag that exports a knob to every rank.  ``spellings``: the first is
    shown, the others are aliases (horovodrun's names where hvdlite's own differ).  ``sets``:
    the value an on/off flag exports (None: the flag takes a value, read as ``value_type``, or
    one of ``choices``, and turned into the variable's text by ``conversion``)."""

    spellings: tuple[str, ...]
    sets: str | None = None
    help: str = ""              # an on/off flag's own words; a value flag uses the knob's help
    metavar: str = ""
    value_type: type = float
    choices: tuple[str, ...] = ()
    conversion: Conversion = AS_GIVEN

    @property
    def dest(self) -> str:
        return self.spellings[0].lstrip("-").replace("-", "_")


def value_flag(*spellings: str, metavar: str, value_type: type = float,
               conversion: Conversion = AS_GIVEN, choices: tuple[str, ...] = ()) -> Flag:
    return Flag(spellings, metavar=metavar, value_type=value_type, conversion=conversion,
                choices=choices)


def on_off_flag(*spellings: str, sets: str, help: str) -> Flag:
    return Flag(spellings, sets=sets, help=help)
