"""``hvdlite run --config-file``: horovodrun's YAML configuration file (no MPI job is started;
tests/launcher/test_horovodrun_flags_jobs.py runs one with a file)."""
from __future__ import annotations

import sys

import pytest

from hvdlite.runner import config_file, horovodrun_flags, launch

pytest.importorskip("yaml")

# Horovod's own example, test/single/data/config.test.yaml in horovod/horovod (its
# test_config_file reads it), copied verbatim.
HOROVOD_EXAMPLE = """\
controller: gloo

params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: true

autotune:
  enabled: true
  log_file: 'horovod_autotune_log.txt'
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 50
  gaussian_process_noise: 0.9

timeline:
  filename: 'horovod_timeline.json'
  mark_cycles: true

stall_check:
  enabled: true
  warning_time_seconds: 120
  shutdown_time_seconds: 240

library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  thread_affinity: 1
  gloo_timeout_seconds: 60


logging:
  level: INFO
  hide_timestamp: true
"""
# The same with what hvdlite refuses turned into what it runs: the MPI controller, MPI
# threads, one NCCL stream, no Gloo timeout.
RUNNABLE = (HOROVOD_EXAMPLE.replace("controller: gloo", "controller: mpi")
            .replace("mpi_threads_disable: true", "mpi_threads_disable: false")
            .replace("num_nccl_streams: 2", "num_nccl_streams: 1")
            .replace("  gloo_timeout_seconds: 60\n", ""))


def parse(argv: list[str], tmp_path, text: str = RUNNABLE):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return launch.parse_args([str(path) if word == "CONFIG" else word for word in argv])


def error(argv: list[str], tmp_path, text: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv, tmp_path, text)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_horovod_s_example_sets_every_knob_it_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parse(["-np", "2", "--config-file", "CONFIG", "cmd"], tmp_path)
    assert launch.knob_env(args) == {
        "HVDLITE_FUSION_THRESHOLD": str(32 * 2**20), "HVDLITE_CYCLE_TIME": "10",
        "HVDLITE_CACHE_CAPACITY": "2048", "HVDLITE_HIERARCHICAL_ALLREDUCE": "1",
        "HVDLITE_HIERARCHICAL_ALLGATHER": "1",
        "HVDLITE_TIMELINE": str(tmp_path / "horovod_timeline.json"),
        "HVDLITE_TIMELINE_MARK_CYCLES": "1", "HVDLITE_STALL_CHECK_DISABLE": "0",
        "HVDLITE_STALL_CHECK_TIME_SECONDS": "120", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "240",
        "HVDLITE_LOG_LEVEL": "INFO", "HVDLITE_AUTOTUNE": "1",
        "HVDLITE_AUTOTUNE_LOG": str(tmp_path / "horovod_autotune_log.txt"),
        "HVDLITE_AUTOTUNE_WARMUP_SAMPLES": "5", "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE": "20",
        "HVDLITE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "50",
        "HVDLITE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.9"}
    assert horovodrun_flags.rank_env(args) == {"HVDLITE_THREAD_AFFINITY": "1"}
    assert args.log_with_timestamp is False and args.num_nccl_streams == 1


def test_every_key_of_horovod_s_example_is_known():
    import yaml
    keys = [key for key, _ in config_file.settings(yaml.safe_load(HOROVOD_EXAMPLE))]
    assert len(keys) == 1 + 5 + 6 + 2 + 3 + 4 + 2


@pytest.mark.parametrize("flags,reason_of", [
    ([], "--gloo"), (["--mpi"], "--mpi-threads-disable"),
])
def test_horovod_s_example_as_is_is_refused_where_hvdlite_differs(flags, reason_of, tmp_path,
                                                                   capsys):
    err = error(["-np", "2", *flags, "--config-file", "CONFIG", "cmd"], tmp_path,
                HOROVOD_EXAMPLE, capsys)
    reason = horovodrun_flags.UNSUPPORTED[(reason_of,)][1]
    assert f"(a horovodrun flag) is not supported: {reason}" in err, err
    assert f"--config-file {tmp_path / 'config.yaml'}: " in err


@pytest.mark.parametrize("change,key,message", [
    (("num_nccl_streams: 1", "num_nccl_streams: 2"), "library_options.num_nccl_streams",
     horovodrun_flags.NCCL_STREAMS),
    (("mpi_threads_disable: false", "gloo_timeout_seconds: 60"),
     "library_options.gloo_timeout_seconds", "hvdlite has no Gloo controller"),
    (("warmup_samples: 5", "warmup_samples: -1"), "autotune.warmup_samples",
     "must be a non-negative"),
    (("enabled: true\n  log_file", "enabled: perhaps\n  log_file"), "autotune.enabled",
     "'perhaps' is not true or false"),
    (("controller: mpi", "controller: nccl"), "controller", "no such controller: 'nccl'"),
    (("fusion_threshold_mb: 32", "fusion_threshold_mb: -1"), "params.fusion_threshold_mb",
     "must be a non-negative number"),
    (("hierarchical_allreduce: true", "hierarchical_allreduce: maybe"),
     "params.hierarchical_allreduce", "'maybe' is not true or false"),
    (("thread_affinity: 1", "thread_affinity: 1,x"), "library_options.thread_affinity",
     "'x' is not a core id"),
    (("level: INFO", "level: LOUD"), "logging.level", "invalid choice"),
])
def test_bad_values_name_their_key(change, key, message, tmp_path, capsys):
    err = error(["-np", "2", "--config-file", "CONFIG", "cmd"], tmp_path,
                RUNNABLE.replace(*change), capsys)
    assert f"config.yaml: {key}: " in err and message in err, err


@pytest.mark.parametrize("change,message", [
    (("params:", "parameters:"), "unknown key 'parameters'; valid keys: controller, params, "
                                 "autotune, timeline, stall_check, library_options, logging"),
    (("mpi_threads_disable:", "mpi_threads_disabled:"),   # Horovod ignores such a typo
     "unknown key 'library_options.mpi_threads_disabled'; valid keys of library_options: "
     "mpi_threads_disable, num_nccl_streams, thread_affinity, gloo_timeout_seconds"),
    (("timeline:\n  filename: 'horovod_timeline.json'\n  mark_cycles: true\n", "timeline: 3\n"),
     "timeline: expected a mapping of filename, mark_cycles, got 3"),
])
def test_unknown_keys_are_named_with_the_valid_ones(change, message, tmp_path, capsys):
    err = error(["-np", "2", "--config-file", "CONFIG", "cmd"], tmp_path,
                RUNNABLE.replace(*change), capsys)
    assert message in err, err


def test_command_line_flags_win_wherever_they_stand(tmp_path):
    args = parse(["-np", "2", "--fusion-threshold-mb", "256", "--config-file", "CONFIG",
                  "--cycle-time-ms", "20", "--no-hierarchical-allgather", "--log-with-timestamp",
                  "--thread-affinity", "0,1", "--no-stall-check", "cmd"], tmp_path)
    env = launch.knob_env(args)
    assert env["HVDLITE_FUSION_THRESHOLD"] == str(256 * 2**20)
    assert env["HVDLITE_CYCLE_TIME"] == "20" and env["HVDLITE_HIERARCHICAL_ALLGATHER"] == "0"
    assert env["HVDLITE_STALL_CHECK_DISABLE"] == "1" and env["HVDLITE_CACHE_CAPACITY"] == "2048"
    assert args.log_with_timestamp is True and args.thread_affinity == "0,1"


def test_autotune_off_and_empty_or_null_sections_are_accepted(tmp_path):
    text = ("autotune:\n  enabled: false\n  warmup_samples: 3\nparams:\n"
            "timeline: {filename: null}\n")
    args = parse(["-np", "2", "--config-file", "CONFIG", "cmd"], tmp_path, text)
    assert launch.knob_env(args) == {"HVDLITE_AUTOTUNE": "0",
                                     "HVDLITE_AUTOTUNE_WARMUP_SAMPLES": "3"}
    assert launch.knob_env(parse(["-np", "2", "--config-file", "CONFIG", "cmd"], tmp_path,
                                 "")) == {}


@pytest.mark.parametrize("text,message", [
    ("- a\n- b\n", "expected a mapping of sections"),
    ("params: [\n", "not valid YAML"),
])
def test_files_that_are_no_configuration(text, message, tmp_path, capsys):
    assert message in error(["-np", "2", "--config-file", "CONFIG", "cmd"], tmp_path, text,
                            capsys)


def test_missing_file_and_missing_pyyaml(tmp_path, monkeypatch, capsys):
    assert launch.main(["-np", "2", "--config-file", str(tmp_path / "none.yaml"), "cmd"]) == 2
    assert "none.yaml: No such file or directory" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "yaml", None)   # import yaml raises ImportError
    assert launch.main(["-np", "2", "--config-file", str(tmp_path / "none.yaml"), "cmd"]) == 2
    assert "--config-file needs PyYAML: pip install pyyaml" in capsys.readouterr().err


def test_no_autotune_on_the_command_line_wins_over_the_file(tmp_path):
    args = parse(["-np", "2", "--no-autotune", "--config-file", "CONFIG", "cmd"], tmp_path)
    env = launch.knob_env(args)
    assert env["HVDLITE_AUTOTUNE"] == "0" and env["HVDLITE_AUTOTUNE_WARMUP_SAMPLES"] == "5"
