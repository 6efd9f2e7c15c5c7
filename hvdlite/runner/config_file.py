"""``hvdlite run --config-file FILE``: horovodrun's YAML configuration file.

The schema is horovodrun's (``horovod/runner/common/util/config_parser.py``,
``set_args_from_config``)::

    controller: mpi                       # gloo is refused, as --gloo is
    params: {fusion_threshold_mb, cycle_time_ms, cache_capacity,
             hierarchical_allreduce, hierarchical_allgather}
    autotune: {enabled, log_file, warmup_samples, steps_per_sample,
               bayes_opt_max_samples, gaussian_process_noise}
    timeline: {filename, mark_cycles}
    stall_check: {enabled, warning_time_seconds, shutdown_time_seconds}
    library_options: {mpi_threads_disable, num_nccl_streams, thread_affinity,
                      gloo_timeout_seconds}
    logging: {level, with_timestamp, hide_timestamp}

Each key stands for the horovodrun flag of the same meaning (:data:`SCHEMA`), and its value is
parsed by ``hvdlite run``'s own parser, so a file says exactly what the flags would, with the
same checks and the same refusals.  A flag given on the command line wins over the file wherever it stands (horovodrun's
implementation; its help text speaks of position, its code does not).  Unlike horovodrun,
which ignores keys it does not know, an unknown key is an error naming it and the valid ones (a
misspelt key would otherwise change nothing, silently); ``logging: hide_timestamp``, which
Horovod's own example file uses but its parser ignores, counts as the opposite of
``with_timestamp``.  The autotune section's other keys are exported whatever ``enabled`` says
(horovodrun exports them only with ``enabled: true``; without it no rank reads them).

PyYAML is an optional dependency (``pip install pyyaml``, or the ``hvdlite[yaml]`` extra).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Mapping

from .launch_errors import UsageError

Tokens = Callable[[Any], list]


def _value(flag: str) -> Tokens:
    """A key whose value is the flag's value."""
    return lambda value: [flag, str(value)]


def _switch(on: str | None, off: str | None) -> Tokens:
    """A true/false key: ``on`` for true, ``off`` for false (None: nothing to add)."""
    def tokens(value: Any) -> list:
        if not isinstance(value, bool) and value not in (0, 1):
            raise ValueError(f"{value!r} is not true or false")
        flag = on if value else off
        return [flag] if flag else []
    return tokens


def _controller(value: Any) -> list:
    if not isinstance(value, str) or value.lower() not in ("mpi", "gloo"):
        raise ValueError(f"no such controller: {value!r} (mpi or gloo)")
    return ["--" + value.lower()]


# section -> key -> the command-line words the key stands for ("" section: top-level keys)
SCHEMA: dict[str, dict[str, Tokens]] = {
    "": {"controller": _controller},
    "params": {"fusion_threshold_mb": _value("--fusion-threshold-mb"),
               "cycle_time_ms": _value("--cycle-time-ms"),
               "cache_capacity": _value("--cache-capacity"),
               "hierarchical_allreduce": _switch("--hierarchical-allreduce",
                                                 "--no-hierarchical-allreduce"),
               "hierarchical_allgather": _switch("--hierarchical-allgather",
                                                 "--no-hierarchical-allgather")},
    "autotune": {"enabled": _switch("--autotune", "--no-autotune"),
                 "log_file": _value("--autotune-log-file"),
                 "warmup_samples": _value("--autotune-warmup-samples"),
                 "steps_per_sample": _value("--autotune-steps-per-sample"),
                 "bayes_opt_max_samples": _value("--autotune-bayes-opt-max-samples"),
                 "gaussian_process_noise": _value("--autotune-gaussian-process-noise")},
    "timeline": {"filename": _value("--timeline-filename"),
                 "mark_cycles": _switch("--timeline-mark-cycles", "--no-timeline-mark-cycles")},
    "stall_check": {"enabled": _switch("--stall-check", "--no-stall-check"),
                    "warning_time_seconds": _value("--stall-check-warning-time-seconds"),
                    "shutdown_time_seconds": _value("--stall-check-shutdown-time-seconds")},
    "library_options": {"mpi_threads_disable": _switch("--mpi-threads-disable", None),
                        "num_nccl_streams": _value("--num-nccl-streams"),
                        "thread_affinity": _value("--thread-affinity"),
                        "gloo_timeout_seconds": _value("--gloo-timeout-seconds")},
    "logging": {"level": _value("--log-level"),
                "with_timestamp": _switch("--log-with-timestamp", "--log-without-timestamp"),
                "hide_timestamp": _switch("--log-without-timestamp", "--log-with-timestamp")},
}


def load(path: str) -> Mapping:
    """The parsed YAML of ``path`` (an empty file is an empty mapping); UsageError when PyYAML
    is missing or the file cannot be read or parsed."""
    try:
        import yaml
    except ImportError:
        raise UsageError("--config-file needs PyYAML: pip install pyyaml "
                         "(or pip install hvdlite[yaml])") from None
    try:
        with open(path, encoding="utf-8") as file:
            config = yaml.safe_load(file)
    except OSError as exc:
        raise UsageError(f"--config-file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"--config-file {path}: not valid YAML: {exc}") from None
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise UsageError(f"--config-file {path}: expected a mapping of sections "
                         f"({', '.join(_valid(''))}), got {type(config).__name__}")
    return config


def _valid(section: str) -> list[str]:
    if section:
        return list(SCHEMA[section])
    return list(SCHEMA[""]) + [name for name in SCHEMA if name]


def settings(config: Mapping) -> list[tuple[str, list]]:
    """``(key, command-line words)`` for every setting of ``config``, the key dotted
    (``params.cycle_time_ms``); ValueError naming an unknown key or a bad value.  Keys whose
    value is empty (``null``) are skipped, as horovodrun does."""
    found = []
    for name, value in config.items():
        if name in SCHEMA[""]:
            items, section = [(name, value)], ""
        elif name in SCHEMA:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ValueError(f"{name}: expected a mapping of {', '.join(_valid(name))}, "
                                 f"got {value!r}")
            items, section = list(value.items()), name
        else:
            raise ValueError(f"unknown key {name!r}; valid keys: {', '.join(_valid(''))}")
        for key, item in items:
            dotted = f"{section}.{key}" if section else key
            if key not in SCHEMA[section]:
                raise ValueError(f"unknown key {dotted!r}; valid keys of {section}: "
                                 f"{', '.join(_valid(section))}")
            if item is None:
                continue
            try:
                found.append((dotted, SCHEMA[section][key](item)))
            except ValueError as exc:
                raise ValueError(f"{dotted}: {exc}") from None
    return found


class _ParseError(Exception):
    pass


def _raise(message: str):
    raise _ParseError(message)


def apply(args: argparse.Namespace, make_parser: Callable[[], argparse.ArgumentParser]) -> None:
    """Set every setting of ``args.config_file`` that the command line left unset (None) in
    ``args``.  ``make_parser``: ``hvdlite run``'s parser, which parses each key's words with
    the checks and refusals of its flags.  UsageError naming the file and the key."""
    path = args.config_file
    config = load(path)
    try:
        found = settings(config)
    except ValueError as exc:
        raise UsageError(f"--config-file {path}: {exc}") from None
    parser = make_parser()
    parser.error = _raise   # argparse (and the horovodrun refusals) report through this
    base = vars(parser.parse_args(["cmd"]))
    for key, words in found:
        if key == "controller" and args.mpi:
            continue   # the command line chose already (horovodrun: --mpi/--gloo)
        try:
            parsed = vars(parser.parse_args(words + ["cmd"]))
        except _ParseError as exc:
            raise UsageError(f"--config-file {path}: {key}: {exc}") from None
        for dest, value in parsed.items():
            if value != base.get(dest) and getattr(args, dest, None) is None:
                setattr(args, dest, value)
