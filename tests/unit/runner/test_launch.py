"""Pure-logic tests of the ``hvdlite run`` launcher: no MPI job is started.

The MPI flavour is fed as fake ``mpiexec --version`` text (or a fake launcher script that records
how it was called), so the MPICH, Intel MPI and Open MPI command lines are all checked here.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from hvdlite.runner import check_build, job_process, launch, mpi_flavor
from hvdlite.runner.mpi_flavor import (INTEL_MPI, MPICH, OPEN_MPI, Host, HostfileError, JobSpec,
                                       MpiFlavor)

MPICH_VERSION = """HYDRA build details:
    Version:                                 4.2.1
    Release Date:                            Wed Apr 17 15:30:02 CDT 2024
    Process Manager:                         pmi
    Launchers available:                     ssh rsh fork slurm ll lsf sge manual persist
MPICH Version:      4.2.1
"""
INTEL_VERSION = ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 "
                 "(id: c2e19c2f3e)\nCopyright 2003-2023, Intel Corporation.\n")
OMPI4_VERSION = ("mpiexec (OpenRTE) 4.1.2\n\n"
                 "Report bugs to http://www.open-mpi.org/community/help/\n")
OMPI5_VERSION = ("mpiexec (Open MPI) 5.0.3\n\n"
                 "Report bugs to https://www.open-mpi.org/community/help/\n")

HYDRA = MpiFlavor(MPICH, (4, 2, 1))
INTEL = MpiFlavor(INTEL_MPI, (2021, 10))
OMPI4 = MpiFlavor(OPEN_MPI, (4, 1, 2))
OMPI5 = MpiFlavor(OPEN_MPI, (5, 0, 3))


def _job(**kwargs) -> JobSpec:
    defaults = dict(np=4, command=["python", "train.py", "--lr", "0.1"])
    defaults.update(kwargs)
    return JobSpec(**defaults)


# --- flavour detection ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, version", [
    (MPICH_VERSION, MPICH, (4, 2, 1)),
    (INTEL_VERSION, INTEL_MPI, (2021, 10)),
    (OMPI4_VERSION, OPEN_MPI, (4, 1, 2)),
    (OMPI5_VERSION, OPEN_MPI, (5, 0, 3)),
    # MPI_Get_library_version() texts, used by --check-build's consistency check
    ("MPICH Version:      5.0.2\nMPICH Release date: ...", MPICH, (5, 0, 2)),
    ("Open MPI v4.1.2, package: Debian OpenMPI, ident: 4.1.2", OPEN_MPI, (4, 1, 2)),
    ("Intel(R) MPI Library 2021.10 for Linux* OS", INTEL_MPI, (2021, 10)),
])
def test_detect_flavor(text, kind, version):
    assert mpi_flavor.detect_flavor(text) == MpiFlavor(kind, version)


def test_detect_flavor_intel_wins_over_hydra_details():
    assert mpi_flavor.detect_flavor(INTEL_VERSION + MPICH_VERSION).kind == INTEL_MPI


@pytest.mark.parametrize("text", ["", "srun: unknown option --version", "Microsoft MPI 10"])
def test_detect_flavor_unknown(text):
    assert mpi_flavor.detect_flavor(text) is None


def test_flavor_description():
    assert HYDRA.description == "MPICH 4.2.1 (Hydra)"
    assert OMPI5.description == "Open MPI 5.0.3"
    assert MpiFlavor(INTEL_MPI).description == "Intel MPI (Hydra)"


# --- command construction: MPICH / Hydra ---------------------------------------------------------
def test_hydra_minimal():
    argv = mpi_flavor.build_command("/v/bin/mpiexec", HYDRA, _job())
    assert argv == ["/v/bin/mpiexec", "-n", "4", "python", "train.py", "--lr", "0.1"]


def test_hydra_hosts_env_and_mpi_args():
    job = _job(hosts=[Host("h1", 2), Host("h2", 2)], mpi_args=["-launcher", "ssh"],
               env={"HVDLITE_FUSION_THRESHOLD": "1048576", "FOO": "a b"})
    argv = mpi_flavor.build_command("mpiexec", HYDRA, job, is_root=True, forward=["PATH"])
    assert argv == ["mpiexec", "-n", "4", "-hosts", "h1:2,h2:2",
                    "-genv", "HVDLITE_FUSION_THRESHOLD", "1048576", "-genv", "FOO", "a b",
                    "-launcher", "ssh", "python", "train.py", "--lr", "0.1"]
    assert "--allow-run-as-root" not in argv  # root handling is Open MPI's business


def test_hydra_hostfile():
    argv = mpi_flavor.build_command("mpiexec", HYDRA, _job(hostfile="/tmp/hf"))
    assert argv[:5] == ["mpiexec", "-n", "4", "-f", "/tmp/hf"]


# --- command construction: Intel MPI -------------------------------------------------------------
def test_intel_machinefile_and_genv():
    job = _job(np=2, hostfile="/tmp/mf", env={"X": "1"})
    argv = mpi_flavor.build_command("mpiexec", INTEL, job)
    assert argv == ["mpiexec", "-n", "2", "-machinefile", "/tmp/mf", "-genv", "X", "1",
                    "python", "train.py", "--lr", "0.1"]


def test_intel_host_list_goes_through_a_machinefile():
    assert mpi_flavor.needs_hostfile(INTEL, hosts_from_file=False)
    with pytest.raises(ValueError, match="machine file"):
        mpi_flavor.build_command("mpiexec", INTEL, _job(hosts=[Host("h1", 2)]))


# --- command construction: Open MPI --------------------------------------------------------------
def test_open_mpi_4_as_root():
    job = _job(hosts=[Host("h1", 2), Host("h2", 1)], env={"HVDLITE_CYCLE_TIME": "5", "FOO": "x"})
    argv = mpi_flavor.build_command("mpirun", OMPI4, job, is_root=True,
                                    forward=["PATH", "PYTHONPATH", "FOO"])
    assert argv == ["mpirun", "-np", "4", "--allow-run-as-root", "--oversubscribe",
                    "--map-by", "slot", "--bind-to", "none", "-H", "h1:2,h2:1",
                    "-x", "HVDLITE_CYCLE_TIME", "-x", "FOO", "-x", "PATH", "-x", "PYTHONPATH",
                    "python", "train.py", "--lr", "0.1"]


def test_open_mpi_5_not_root_with_hostfile():
    argv = mpi_flavor.build_command("mpirun", OMPI5, _job(hostfile="/tmp/hf"), is_root=False)
    assert "--allow-run-as-root" not in argv
    assert "--oversubscribe" not in argv  # deprecated in Open MPI 5
    assert argv[:8] == ["mpirun", "-np", "4", "--map-by", "slot:OVERSUBSCRIBE",
                        "--bind-to", "none", "--hostfile"]
    assert argv[8] == "/tmp/hf"


def test_open_mpi_unknown_version_uses_classic_flags():
    argv = mpi_flavor.build_command("mpirun", MpiFlavor(OPEN_MPI), _job())
    assert "--oversubscribe" in argv and argv[argv.index("--map-by") + 1] == "slot"


def test_hosts_and_hostfile_are_exclusive():
    with pytest.raises(ValueError):
        mpi_flavor.build_command("mpiexec", HYDRA, _job(hosts=[Host("a")], hostfile="f"))


def test_open_mpi_forward_lists_only_set_variables():
    assert mpi_flavor.open_mpi_forward({"PATH": "/bin", "PYTHONPATH": ""}) == ["PATH"]


# --- hosts and hostfiles -------------------------------------------------------------------------
def test_parse_hosts():
    assert mpi_flavor.parse_hosts("h1:2, h2:4,h3") == [Host("h1", 2), Host("h2", 4), Host("h3", 1)]


@pytest.mark.parametrize("spec", ["", "h1:0", "h1:x", ":2", "h1:-1"])
def test_parse_hosts_errors(spec):
    with pytest.raises(HostfileError):
        mpi_flavor.parse_hosts(spec)


def test_parse_hostfile_formats():
    text = ("# cluster\n"
            "node1 slots=4\n"
            "node2:2   # MPICH style\n"
            "\n"
            "node3\n"
            "node4 slots=2 max_slots=8\n")
    assert mpi_flavor.parse_hostfile_text(text) == [
        Host("node1", 4), Host("node2", 2), Host("node3", 1), Host("node4", 2)]


@pytest.mark.parametrize("text, message", [
    ("", "no hosts"), ("# only a comment\n", "no hosts"),
    ("node1 cpus=4\n", "hf:1: unsupported field"), ("a\nnode2 slots=zero\n", "hf:2"),
])
def test_parse_hostfile_errors(text, message):
    with pytest.raises(HostfileError, match=message):
        mpi_flavor.parse_hostfile_text(text, "hf")


def test_render_hostfile_per_flavor():
    hosts = [Host("a", 2), Host("b", 1)]
    assert mpi_flavor.render_hostfile(OMPI4, hosts) == "a slots=2\nb slots=1\n"
    assert mpi_flavor.render_hostfile(HYDRA, hosts) == "a:2\nb:1\n"
    assert mpi_flavor.render_hostfile(INTEL, hosts) == "a:2\nb:1\n"


def test_needs_hostfile():
    assert mpi_flavor.needs_hostfile(HYDRA, True) and mpi_flavor.needs_hostfile(OMPI4, True)
    assert not mpi_flavor.needs_hostfile(HYDRA, False)
    assert not mpi_flavor.needs_hostfile(OMPI5, False)


# --- environment ---------------------------------------------------------------------------------
def test_child_environment_puts_bin_dir_first_once():
    base = {"PATH": "/usr/bin:/venv/bin:/bin", "KEEP": "1"}
    env = mpi_flavor.child_environment(base, {"FOO": "bar"}, "/venv/bin")
    assert env["PATH"] == "/venv/bin:/usr/bin:/bin"
    assert env["KEEP"] == "1" and env["FOO"] == "bar"
    assert base["PATH"] == "/usr/bin:/venv/bin:/bin"  # not modified
    assert mpi_flavor.child_environment({}, {}, "/venv/bin")["PATH"] == "/venv/bin"


def test_knob_env_maps_every_flag():
    args = launch.parse_args(["run", "-np", "2", "--fusion-threshold-mb", "64",
                              "--cycle-time-ms", "2.5", "--cache-capacity", "0",
                              "--stall-check-seconds", "30", "--stall-shutdown-seconds", "120",
                              "--no-stall-check", "--log-level", "debug",
                              "--timeline-filename", "/tmp/tl.json", "--timeline-mark-cycles",
                              "python", "t.py"])
    assert launch.knob_env(args) == {
        "HVDLITE_FUSION_THRESHOLD": str(64 * 1024 * 1024),
        "HVDLITE_CYCLE_TIME": "2.5",
        "HVDLITE_CACHE_CAPACITY": "0",
        "HVDLITE_STALL_CHECK_TIME_SECONDS": "30",
        "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "120",
        "HVDLITE_STALL_CHECK_DISABLE": "1",
        "HVDLITE_LOG_LEVEL": "DEBUG",
        "HVDLITE_TIMELINE": "/tmp/tl.json",
        "HVDLITE_TIMELINE_MARK_CYCLES": "1",
    }


def test_knob_env_horovodrun_spellings_and_fractions():
    args = launch.parse_args(["-np", "2", "--fusion-threshold-mb", "0.5",
                              "--stall-check-warning-time-seconds", "5",
                              "--stall-check-shutdown-time-seconds", "7.5",
                              "--log-level", "TRACE", "cmd"])
    env = launch.knob_env(args)
    assert env["HVDLITE_FUSION_THRESHOLD"] == "524288"
    assert env["HVDLITE_STALL_CHECK_TIME_SECONDS"] == "5"
    assert env["HVDLITE_STALL_SHUTDOWN_TIME_SECONDS"] == "7.5"
    assert env["HVDLITE_LOG_LEVEL"] == "DEBUG"  # Python logging has no TRACE


def test_knob_env_empty_when_no_flags():
    assert launch.knob_env(launch.parse_args(["-np", "2", "cmd"])) == {}


def test_knob_env_is_what_the_engine_reads():
    from hvdlite.common.config import Config
    args = launch.parse_args(["-np", "2", "--fusion-threshold-mb", "1", "--cycle-time-ms", "3",
                              "--cache-capacity", "7", "--no-stall-check",
                              "--log-level", "info", "cmd"])
    config = Config.from_env(launch.knob_env(args))
    assert (config.fusion_threshold, config.cycle_time_ms, config.cache_capacity) == (
        1048576, 3.0, 7)
    assert not config.stall_check_enabled and config.log_level == "INFO"


# Every spelling of every tuning flag: (arguments, variable, exported text, Config field, value),
# written out by hand (Horovod's config_parser.set_env_from_args: MB * 1024 * 1024, on/off flags
# as 1/0).  A flag added to the knob table without a line here fails the coverage test.
FLAG_CASES = {
    "--fusion-threshold-mb": (["3"], "HVDLITE_FUSION_THRESHOLD", "3145728",
                              "fusion_threshold", 3145728),
    "--cycle-time-ms": (["0.5"], "HVDLITE_CYCLE_TIME", "0.5", "cycle_time_ms", 0.5),
    "--cache-capacity": (["12"], "HVDLITE_CACHE_CAPACITY", "12", "cache_capacity", 12),
    "--stall-check-seconds": (["9"], "HVDLITE_STALL_CHECK_TIME_SECONDS", "9",
                              "stall_check_seconds", 9.0),
    "--stall-check-warning-time-seconds": (["11"], "HVDLITE_STALL_CHECK_TIME_SECONDS", "11",
                                           "stall_check_seconds", 11.0),
    "--stall-shutdown-seconds": (["2.5"], "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS", "2.5",
                                 "stall_shutdown_seconds", 2.5),
    "--stall-check-shutdown-time-seconds": (["4"], "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS", "4",
                                            "stall_shutdown_seconds", 4.0),
    "--no-stall-check": ([], "HVDLITE_STALL_CHECK_DISABLE", "1", "stall_check_enabled", False),
    "--stall-check": ([], "HVDLITE_STALL_CHECK_DISABLE", "0", "stall_check_enabled", True),
    "--log-level": (["fatal"], "HVDLITE_LOG_LEVEL", "CRITICAL", "log_level", "CRITICAL"),
    "--timeline-filename": (["/tmp/x/../tl.json"], "HVDLITE_TIMELINE", "/tmp/tl.json",
                            "timeline_filename", "/tmp/tl.json"),
    "--timeline-mark-cycles": ([], "HVDLITE_TIMELINE_MARK_CYCLES", "1",
                               "timeline_mark_cycles", True),
    "--no-timeline-mark-cycles": ([], "HVDLITE_TIMELINE_MARK_CYCLES", "0",
                                  "timeline_mark_cycles", False),
    "--hierarchical-allreduce": ([], "HVDLITE_HIERARCHICAL_ALLREDUCE", "1",
                                 "hierarchical_allreduce", True),
    "--no-hierarchical-allreduce": ([], "HVDLITE_HIERARCHICAL_ALLREDUCE", "0",
                                    "hierarchical_allreduce", False),
    "--hierarchical-allgather": ([], "HVDLITE_HIERARCHICAL_ALLGATHER", "1",
                                 "hierarchical_allgather", True),
    "--no-hierarchical-allgather": ([], "HVDLITE_HIERARCHICAL_ALLGATHER", "0",
                                    "hierarchical_allgather", False),
    "--autotune": ([], "HVDLITE_AUTOTUNE", "1", "autotune", True),
    "--no-autotune": ([], "HVDLITE_AUTOTUNE", "0", "autotune", False),
    "--autotune-log-file": (["/tmp/x/../at.csv"], "HVDLITE_AUTOTUNE_LOG", "/tmp/at.csv",
                            "autotune_log", "/tmp/at.csv"),
    "--autotune-warmup-samples": (["2"], "HVDLITE_AUTOTUNE_WARMUP_SAMPLES", "2",
                                  "autotune_warmup_samples", 2),
    "--autotune-steps-per-sample": (["4"], "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE", "4",
                                    "autotune_steps_per_sample", 4),
    "--autotune-bayes-opt-max-samples": (["9"], "HVDLITE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "9",
                                         "autotune_bayes_opt_max_samples", 9),
    "--autotune-gaussian-process-noise": (["0.5"], "HVDLITE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
                                          "0.5", "autotune_gaussian_process_noise", 0.5),
}


def test_every_tuning_flag_has_a_case():
    from hvdlite.common.config import KNOBS
    spellings = {s for knob in KNOBS for flag in knob.flags for s in flag.spellings}
    assert spellings == set(FLAG_CASES)


@pytest.mark.parametrize("flag", sorted(FLAG_CASES))
def test_every_flag_exports_its_variable_in_the_variable_s_unit(flag):
    from hvdlite.common.config import Config
    values, variable, text, field, value = FLAG_CASES[flag]
    env = launch.knob_env(launch.parse_args(["-np", "2", flag] + values + ["cmd"]))
    assert env == {variable: text}
    assert getattr(Config.from_env(env), field) == value   # what the ranks will read


@pytest.mark.parametrize("pair", [("--no-stall-check", "--stall-check"),
                                  ("--timeline-mark-cycles", "--no-timeline-mark-cycles"),
                                  ("--hierarchical-allreduce", "--no-hierarchical-allreduce"),
                                  ("--hierarchical-allgather", "--no-hierarchical-allgather"),
                                  ("--autotune", "--no-autotune")])
def test_on_off_flags_exclude_each_other(pair, capsys):
    """As in horovodrun (a mutually exclusive group)."""
    assert launch.main(["-np", "2", *pair, "cmd"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_on_flag_overrides_x():
    args = launch.parse_args(["-np", "2", "-x", "HVDLITE_STALL_CHECK_DISABLE=1",
                              "--stall-check", "cmd"])
    assert launch.job_env(args, {})["HVDLITE_STALL_CHECK_DISABLE"] == "0"


def test_relative_timeline_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = launch.knob_env(launch.parse_args(["-np", "2", "--timeline-filename", "t.json", "c"]))
    assert env == {"HVDLITE_TIMELINE": str(tmp_path / "t.json")}


def test_help_names_each_flag_s_variable(capsys):
    from hvdlite.common.config import KNOBS
    with pytest.raises(SystemExit):
        launch.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for knob in KNOBS:
        for flag in knob.flags:
            assert flag.spellings[0] in text
            assert knob.variable in text


def test_parse_env_args():
    environ = {"HOME_DIR": "/home/u", "EMPTY": ""}
    assert launch.parse_env_args(["HOME_DIR", "FOO=bar", "EQ=a=b", "BLANK=", "EMPTY"],
                                 environ) == {"HOME_DIR": "/home/u", "FOO": "bar", "EQ": "a=b",
                                              "BLANK": "", "EMPTY": ""}


@pytest.mark.parametrize("item, message", [("MISSING", "not set"), ("=x", "not a valid"),
                                           ("1A=x", "not a valid"), ("A-B=x", "not a valid")])
def test_parse_env_args_errors(item, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.parse_env_args([item], {})


def test_job_env_knobs_win_over_x():
    args = launch.parse_args(["-np", "2", "-x", "HVDLITE_CYCLE_TIME=9", "-x", "A=1",
                              "--cycle-time-ms", "2", "cmd"])
    assert launch.job_env(args, {}) == {"HVDLITE_CYCLE_TIME": "2", "A": "1"}


# --- argument parsing ----------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", [[], ["run"]])
@pytest.mark.parametrize("np_flag", ["-np", "-n", "--num-proc"])
def test_parse_args_run_optional_and_np_spellings(prefix, np_flag):
    args = launch.parse_args(prefix + [np_flag, "3", "python", "train.py", "-np", "9", "-x", "Y"])
    assert args.np == 3
    assert args.command == ["python", "train.py", "-np", "9", "-x", "Y"]  # untouched
    assert args.env == []


def test_parse_args_double_dash_and_repeated_x():
    args = launch.parse_args(["run", "-np", "2", "-x", "A", "-x", "B=2", "--hosts", "h:2",
                              "--mpi-args=-verbose", "--", "python", "t.py"])
    assert args.command == ["python", "t.py"]
    assert args.env == ["A", "B=2"] and args.hosts == "h:2" and args.mpi_args == "-verbose"


def test_parse_args_mpi_args_with_spaces():
    args = launch.parse_args(["-np", "2", "--mpi-args", "-genv FOO 1 -l", "cmd"])
    assert args.mpi_args == "-genv FOO 1 -l"


def test_parse_args_check_build_without_command():
    for argv in (["--check-build"], ["run", "--check-build"]):
        args = launch.parse_args(argv)
        assert args.check_build and args.command == []


@pytest.mark.parametrize("argv", [["-np", "0", "cmd"], ["-np", "x", "cmd"],
                                  ["-H", "a", "--hostfile", "f", "cmd"],
                                  ["--fusion-threshold-mb", "-1", "cmd"],
                                  ["--log-level", "loud", "cmd"], ["--np", "2", "cmd"]])
def test_parse_args_rejects(argv, capsys):
    assert launch.main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_process_count():
    args = launch.parse_args(["-H", "a:2,b:3", "cmd"])
    hosts, from_file = launch.resolve_hosts(args)
    assert launch.process_count(args, hosts) == 5 and not from_file
    with pytest.raises(launch.LaunchError, match="-np N is required"):
        launch.process_count(launch.parse_args(["cmd"]), None)


def test_hostfile_is_rewritten_for_the_flavor(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\nn2:3\n")
    args = launch.parse_args(["--hostfile", str(hostfile), "python", "t.py"])
    for flavor, expected in ((OMPI4, "n1 slots=2\nn2 slots=3\n"), (HYDRA, "n1:2\nn2:3\n")):
        workdir = tmp_path / flavor.kind
        workdir.mkdir()
        spec, from_file = launch.plan_job(args, {})
        assert from_file and spec.np == 5
        launch.place_hosts(spec, flavor, from_file, str(workdir))
        assert spec.hosts is None
        assert Path(spec.hostfile).read_text() == expected


def test_host_list_stays_on_the_command_line_except_for_intel(tmp_path):
    args = launch.parse_args(["-np", "2", "-H", "n1:1,n2:1", "--mpi-args", "-l -v", "cmd"])
    spec, from_file = launch.plan_job(args, {})
    launch.place_hosts(spec, HYDRA, from_file, str(tmp_path))
    assert spec.hosts == [Host("n1"), Host("n2")] and spec.hostfile is None
    assert spec.mpi_args == ["-l", "-v"]
    intel, from_file = launch.plan_job(args, {})
    launch.place_hosts(intel, INTEL, from_file, str(tmp_path))
    assert intel.hosts is None and Path(intel.hostfile).read_text() == "n1:1\nn2:1\n"


@pytest.mark.parametrize("argv, message", [
    (["--hostfile", "/nonexistent/hosts", "cmd"], "cannot read hostfile"),
    (["-H", "a:0", "cmd"], "at least 1"),
    (["-np", "2", "--mpi-args", "-genv 'A", "cmd"], "--mpi-args"),
    (["-np", "2"], "no command given"),
])
def test_plan_job_usage_errors(argv, message):
    with pytest.raises(launch.UsageError, match=message):
        launch.plan_job(launch.parse_args(argv), {})


def test_usage_errors_come_before_looking_for_mpi(monkeypatch, capsys):
    monkeypatch.setattr(mpi_flavor, "find_launcher", lambda *a, **k: None)
    assert launch.main(["run", "python", "t.py"]) == 2
    assert "-np N is required" in capsys.readouterr().err


# --- finding the launcher ------------------------------------------------------------------------
def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_find_launcher_prefers_the_one_next_to_python(tmp_path):
    venv, system = tmp_path / "venv", tmp_path / "system"
    venv.mkdir()
    system.mkdir()
    _executable(system / "mpiexec")
    python = str(venv / "python")
    assert mpi_flavor.find_launcher(python, path=str(system)) == str(system / "mpiexec")
    _executable(venv / "mpiexec")
    assert mpi_flavor.find_launcher(python, path=str(system)) == str(venv / "mpiexec")


def test_find_launcher_mpirun_fallback_and_none(tmp_path):
    _executable(tmp_path / "mpirun")
    python = str(tmp_path / "nowhere" / "python")
    assert mpi_flavor.find_launcher(python, path=str(tmp_path)) == str(tmp_path / "mpirun")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert mpi_flavor.find_launcher(python, path=str(empty)) is None


def test_main_without_launcher_names_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(mpi_flavor, "find_launcher", lambda *a, **k: None)
    assert launch.main(["run", "-np", "2", "python", "t.py"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "no MPI launcher" in err and "pip install mpich" in err


def test_main_without_command(capsys):
    assert launch.main(["run", "-np", "2"]) == 2
    assert "no command given" in capsys.readouterr().err


def test_unknown_launcher_is_an_error(tmp_path):
    fake = _executable(tmp_path / "mpiexec", "#!/bin/sh\necho 'something else 1.0'\n")
    with pytest.raises(launch.LaunchError, match="not MPICH, Intel MPI or Open MPI"):
        launch.detect_launcher(str(fake))


# --- end to end with a fake launcher that records its argv and environment -----------------------
FAKE_LAUNCHER = """#!{python}
import json, os, sys
if sys.argv[1:] == ["--version"]:
    sys.stdout.write({version!r})
    sys.exit(0)
with open({record!r}, "w") as f:
    json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, f)
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


def _fake_launcher(tmp_path: Path, version: str) -> tuple[Path, Path]:
    record = tmp_path / "record.json"
    script = FAKE_LAUNCHER.format(python=sys.executable, version=version, record=str(record))
    return _executable(tmp_path / "fake-mpiexec", script), record


def test_end_to_end_open_mpi(tmp_path, monkeypatch, capsys):
    fake, record = _fake_launcher(tmp_path, OMPI4_VERSION)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1:2\n")
    monkeypatch.setenv("PASSED", "from-launcher")
    monkeypatch.setenv("FAKE_EXIT", "7")
    code = launch.main(["run", "--mpiexec", str(fake), "--hostfile", str(hostfile),
                        "--skip-host-check", "-x", "PASSED", "-x", "FOO=bar",
                        "--cycle-time-ms", "2", "--verbose", "python", "t.py"])
    assert code == 7  # the launcher's exit status comes back
    seen = json.loads(record.read_text())
    argv, env = seen["argv"], seen["env"]
    assert argv[1:3] == ["-np", "2"] and argv[-2:] == ["python", "t.py"]
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    for name in ("PASSED", "FOO", "HVDLITE_CYCLE_TIME", "PATH"):
        assert argv[argv.index(name) - 1] == "-x"
    assert env["PASSED"] == "from-launcher" and env["FOO"] == "bar"
    assert env["HVDLITE_CYCLE_TIME"] == "2"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    rendered = argv[argv.index("--hostfile") + 1]
    assert rendered != str(hostfile) and not os.path.exists(rendered)  # temp copy, cleaned up
    err = capsys.readouterr().err
    assert f"{fake} -np 2" in err and "Open MPI 4.1.2" in err


def test_end_to_end_intel_host_list(tmp_path, monkeypatch, capsys):
    fake, record = _fake_launcher(tmp_path, INTEL_VERSION)
    monkeypatch.delenv("FAKE_EXIT", raising=False)
    assert launch.main(["--mpiexec", str(fake), "-H", "a:1,b:1", "--skip-host-check",
                        "-x", "Z=1", "cmd"]) == 0
    argv = json.loads(record.read_text())["argv"]
    assert argv[1:4] == ["-n", "2", "-machinefile"]
    assert argv[5:] == ["-genv", "Z", "1", "cmd"]


def test_end_to_end_mpich_verbose(tmp_path, monkeypatch, capsys):
    fake, record = _fake_launcher(tmp_path, MPICH_VERSION)
    monkeypatch.delenv("FAKE_EXIT", raising=False)
    assert launch.main(["run", "--mpiexec", str(fake), "-np", "2", "--verbose",
                        "--fusion-threshold-mb", "1", "python", "-c", "print(1)"]) == 0
    argv = json.loads(record.read_text())["argv"]
    assert argv[1:] == ["-n", "2", "-genv", "HVDLITE_FUSION_THRESHOLD", "1048576",
                        "python", "-c", "print(1)"]
    assert (f"{fake} -n 2 -genv HVDLITE_FUSION_THRESHOLD 1048576 python -c 'print(1)'"
            in capsys.readouterr().err)


def test_run_job_exit_status():
    assert launch.run_job([sys.executable, "-c", "raise SystemExit(5)"], os.environ) == 5
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert launch.run_job([sys.executable, "-c", killed], os.environ) == 128 + 9


def test_run_job_cannot_start():
    with pytest.raises(launch.LaunchError, match="cannot start /nonexistent/mpiexec"):
        launch.run_job(["/nonexistent/mpiexec", "-n", "2"], os.environ)


def test_run_job_kills_a_group_that_ignores_sigterm(monkeypatch, tmp_path):
    monkeypatch.setattr(job_process, "KILL_GRACE_SECONDS", 0.3)
    ready = tmp_path / "ready"
    stubborn = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                " pathlib.Path(sys.argv[1]).touch(); time.sleep(60)")

    def send_sigterm_when_ready() -> None:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)  # handled by run_job's handler in the main thread

    before = signal.getsignal(signal.SIGTERM)
    sender = threading.Thread(target=send_sigterm_when_ready)
    sender.start()
    start = time.monotonic()
    status = launch.run_job([sys.executable, "-c", stubborn, str(ready)], os.environ)
    sender.join()
    assert status == 128 + signal.SIGTERM
    assert time.monotonic() - start < 15
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back


# --- check-build ---------------------------------------------------------------------------------
FEATURES = {"version": "9.9.9", "mpi": True, "nccl": 0, "gloo": False, "ddl": False,
            "ccl": False}


def _section(report: str, title: str) -> list[str]:
    lines = report.splitlines()
    start = lines.index(title + ":") + 1
    end = lines.index("", start)
    return lines[start:end]


def test_format_report_marks():
    report = check_build.format_report(FEATURES, [("TensorFlow", False), ("PyTorch", True)],
                                       "MPICH Version: 5.0.2", "/v/bin/mpiexec (MPICH)")
    assert report.startswith("hvdlite v9.9.9:\n")
    assert _section(report, "Available Frameworks") == ["    [ ] TensorFlow", "    [X] PyTorch"]
    assert _section(report, "Available Controllers") == ["    [X] MPI", "    [ ] Gloo"]
    assert _section(report, "Available Tensor Operations") == [
        "    [ ] NCCL", "    [ ] DDL", "    [ ] CCL", "    [X] MPI", "    [ ] Gloo"]
    assert "MPI library: MPICH Version: 5.0.2" in report


def test_format_report_nccl_version_and_no_mpi():
    features = dict(FEATURES, nccl=21803, mpi=False, gloo=True)
    report = check_build.format_report(features, [], None, "not found")
    ops = _section(report, "Available Tensor Operations")
    assert "    [X] NCCL (2.18.3)" in ops and "    [ ] MPI" in ops and "    [X] Gloo" in ops
    assert "MPI library: not available" in report


@pytest.mark.parametrize("code, text", [(21803, "2.18.3"), (22105, "2.21.5"), (2708, "2.7.8")])
def test_nccl_version_string(code, text):
    assert check_build.nccl_version_string(code) == text


def test_check_build_follows_the_queries(monkeypatch):
    import hvdlite
    from hvdlite.common import core
    monkeypatch.setattr(core, "nccl_built", lambda: 21602)
    monkeypatch.setattr(core, "gloo_built", lambda: True)
    monkeypatch.setattr(core, "ccl_built", lambda: False)
    monkeypatch.setattr(check_build, "mpi_library_version", lambda: "Open MPI v4.1.2, package")
    monkeypatch.setattr(check_build, "launcher_description",
                        lambda launcher=None: ("/x/mpiexec (MPICH)", HYDRA))
    report = check_build.check_build_report()
    assert report.startswith(f"hvdlite v{hvdlite.__version__}:")
    ops = _section(report, "Available Tensor Operations")
    assert "    [X] NCCL (2.16.2)" in ops and "    [X] Gloo" in ops and "    [ ] CCL" in ops
    assert ("    [X] MPI" in ops) == bool(hvdlite.mpi_built())
    frameworks = _section(report, "Available Frameworks")
    torch_there = check_build.module_available("torch")
    assert ("    [X] PyTorch" in frameworks) == torch_there
    assert "WARNING: mpi4py is built against Open MPI but the launcher is MPICH" in report


@pytest.mark.parametrize("scope,expect", [("0\n", "process_vm_readv found (a job tries"),
                                          ("1\n", "ptrace_scope is 1, so each rank lets in"),
                                          ("2", "ptrace_scope is 2: ranks may read"),
                                          ("3", "ptrace_scope is 3"),
                                          (None, "process_vm_readv found (a job tries")])
def test_check_build_reports_direct_copies(tmp_path, scope, expect):
    path = tmp_path / "ptrace_scope"
    if scope is not None:
        path.write_text(scope)
    assert expect in check_build.cma_line(str(path))


def test_check_build_lists_direct_copies(monkeypatch):
    monkeypatch.setattr(check_build, "cma_line", lambda: "probe text")
    assert "\nDirect copies between ranks: probe text\n" in check_build.check_build_report()


def test_mismatch_ignores_mpich_intel_pairs():
    assert check_build._mismatch("MPICH Version: 4.2", INTEL) is None
    assert check_build._mismatch("MPICH Version: 4.2", HYDRA) is None
    assert check_build._mismatch("Open MPI v5.0.3", OMPI5) is None
    assert check_build._mismatch("MPICH Version: 4.2", OMPI5) is not None
