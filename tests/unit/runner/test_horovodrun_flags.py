"""Pure-logic tests of the horovodrun flags that ``hvdlite run`` takes (no MPI job is started;
the jobs with ``--output-filename`` run in tests/launcher/test_hvdlite_run.py)."""
from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading

import pytest

import hvdlite
from hvdlite.common.runtime import affinity
from hvdlite.runner import horovodrun_flags, launch, mpi_flavor, rank_output
from hvdlite.runner.mpi_flavor import INTEL_MPI, MPICH, OPEN_MPI, MpiFlavor

HYDRA = MpiFlavor(MPICH, (4, 2, 1))
INTEL = MpiFlavor(INTEL_MPI, (2021, 10))
OMPI4 = MpiFlavor(OPEN_MPI, (4, 1, 2))
OMPI5 = MpiFlavor(OPEN_MPI, (5, 0, 3))
# Horovod's prefix (safe_shell_exec.prefix_connection): time.asctime() then [rank]<stream>:
STAMP = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"


def plan(argv: list[str], environ: dict | None = None) -> mpi_flavor.JobSpec:
    spec, _ = launch.plan_job(launch.parse_args(argv), environ or {})
    return spec


def test_accepted_no_op_flags_change_nothing():
    plain = plan(["-np", "2", "python", "t.py"])
    compat = plan(["-np", "2", "--mpi", "--disable-cache", "--num-nccl-streams",
                   "1", "--log-without-timestamp", "python", "t.py"])
    assert compat == plain
    assert plan(["-np", "2", "--log-hide-timestamp", "python", "t.py"]) == plain


def test_num_nccl_streams_other_than_one_is_refused(capsys):
    assert launch.main(["-np", "2", "--num-nccl-streams", "2", "python", "t.py"]) == 2
    assert horovodrun_flags.NCCL_STREAMS in capsys.readouterr().err


def test_check_build_short_spelling():
    assert launch.parse_args(["-cb"]).check_build


def test_version_flag(capsys):
    for flag in ("-v", "--version"):
        assert launch.main([flag]) == 0
        assert capsys.readouterr().out.strip() == f"hvdlite {hvdlite.__version__}"


@pytest.mark.parametrize("flags", list(horovodrun_flags.UNSUPPORTED), ids=lambda f: f[-1])
def test_unsupported_horovodrun_flags_say_why(flags, capsys):
    nargs, reason = horovodrun_flags.UNSUPPORTED[flags]
    for flag in flags:
        argv = ["-np", "2", flag] + ["7"] * nargs + ["python", "t.py"]
        assert launch.main(argv) == 2
        err = capsys.readouterr().err
        assert f"{flag} (a horovodrun flag) is not supported: {reason}" in err, err


# horovodrun's flags for knobs hvdlite has (Horovod's horovod/runner/launch.py, parse_args, and
# config_parser.set_env_from_args): flag, its value, the variable and value the ranks get.
# --stall-check and --no-timeline-mark-cycles are horovodrun's hidden counterparts.
HOROVODRUN_KNOB_FLAGS = [
    ("--fusion-threshold-mb", ["32"], "FUSION_THRESHOLD", str(32 * 1024 * 1024)),
    ("--cycle-time-ms", ["5"], "CYCLE_TIME", "5"),
    ("--cache-capacity", ["2048"], "CACHE_CAPACITY", "2048"),
    ("--timeline-filename", ["/tmp/tl.json"], "TIMELINE", "/tmp/tl.json"),
    ("--timeline-mark-cycles", [], "TIMELINE_MARK_CYCLES", "1"),
    ("--no-timeline-mark-cycles", [], "TIMELINE_MARK_CYCLES", "0"),
    ("--no-stall-check", [], "STALL_CHECK_DISABLE", "1"),
    ("--stall-check", [], "STALL_CHECK_DISABLE", "0"),
    ("--stall-check-warning-time-seconds", ["120"], "STALL_CHECK_TIME_SECONDS", "120"),
    ("--stall-check-shutdown-time-seconds", ["300"], "STALL_SHUTDOWN_TIME_SECONDS", "300"),
    ("--log-level", ["WARNING"], "LOG_LEVEL", "WARNING"),
]


@pytest.mark.parametrize("flag,values,knob,value", HOROVODRUN_KNOB_FLAGS,
                         ids=[case[0] for case in HOROVODRUN_KNOB_FLAGS])
def test_horovodrun_knob_flags_set_the_same_knob(flag, values, knob, value):
    env = launch.knob_env(launch.parse_args(["-np", "2", flag] + values + ["python", "t.py"]))
    assert env == {"HVDLITE_" + knob: value}


def test_no_knob_flag_is_also_refused():
    from hvdlite.common.config import KNOBS
    knob_flags = {s for knob in KNOBS for flag in knob.flags for s in flag.spellings}
    refused = {s for spellings in horovodrun_flags.UNSUPPORTED for s in spellings}
    assert not knob_flags & refused


def test_unsupported_flag_inside_the_command_is_the_command_s():
    args = launch.parse_args(["-np", "2", "python", "t.py", "--gloo", "-p", "5"])
    assert args.command == ["python", "t.py", "--gloo", "-p", "5"]


def test_output_filename_wraps_the_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # a relative DIR is made absolute (ranks may start elsewhere)
    spec = plan(["-np", "3", "--output-filename", "logs", "python", "t.py", "--lr", "1"])
    assert spec.command == [sys.executable, "-m", "hvdlite.runner.rank_output",
                            str(tmp_path / "logs"), "3", "python", "t.py", "--lr", "1"]


def test_network_interfaces_union_in_order():
    args = launch.parse_args(["-np", "2", "--network-interface", "eth0",
                              "--network-interfaces", "ib0, eth0", "--network-interface", "ib1",
                              "cmd"])
    assert args.nics == ["eth0", "ib0", "ib1"]


def test_network_interfaces_per_flavor():
    spec = plan(["-np", "2", "--network-interfaces", "eth0,ib0", "cmd"])
    assert spec.env["NCCL_SOCKET_IFNAME"] == "eth0,ib0"
    argv = mpi_flavor.build_command("mpirun", OMPI4, spec)
    at = argv.index("btl_tcp_if_include")
    assert argv[at - 1:at + 2] == ["--mca", "btl_tcp_if_include", "eth0,ib0"]
    with pytest.raises(ValueError, match="takes one network interface"):
        mpi_flavor.build_command("mpiexec", HYDRA, spec)
    one = plan(["-np", "2", "--network-interface", "ib0", "cmd"])
    for flavor in (HYDRA, INTEL):
        argv = mpi_flavor.build_command("mpiexec", flavor, one)
        assert argv[argv.index("-iface") + 1] == "ib0"


def test_network_interface_does_not_override_an_explicit_nccl_setting():
    spec = plan(["-np", "2", "-x", "NCCL_SOCKET_IFNAME=lo", "--network-interface", "eth0",
                 "cmd"])
    assert spec.env["NCCL_SOCKET_IFNAME"] == "lo"
    assert "NCCL_SOCKET_IFNAME" not in plan(["-np", "2", "cmd"]).env


def test_several_interfaces_with_hydra_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(launch, "detect_launcher", lambda explicit: ("mpiexec", HYDRA))
    assert launch.main(["-np", "2", "--network-interfaces", "a,b", "cmd"]) == 2
    assert "takes one network interface (-iface), got a,b" in capsys.readouterr().err


def test_binding_args_come_before_mpi_args():
    spec = plan(["-np", "2", "--binding-args=--bind-to core", "--mpi-args=-l", "cmd"])
    assert spec.mpi_args == ["--bind-to", "core", "-l"]
    with pytest.raises(launch.UsageError, match="--binding-args"):
        plan(["-np", "2", "--binding-args", "'unclosed", "cmd"])


# --- the per-rank output wrapper --------------------------------------------------------------
@pytest.mark.parametrize("np_, rank, name", [(1, 0, "rank.0"), (10, 3, "rank.3"),
                                             (11, 3, "rank.03"), (11, 10, "rank.10"),
                                             (1000, 7, "rank.007")])
def test_rank_directory_pads_to_sort_in_rank_order(tmp_path, np_, rank, name):
    assert rank_output.rank_directory(tmp_path, rank, np_) == tmp_path / name


def test_launcher_rank_from_each_launcher_s_variable():
    assert rank_output.launcher_rank({"PMI_RANK": "4"}) == 4
    assert rank_output.launcher_rank({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert rank_output.launcher_rank({"PMIX_RANK": "1", "PMI_RANK": ""}) == 1
    with pytest.raises(ValueError, match="PMI_RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK"):
        rank_output.launcher_rank({})


def test_wrapper_tees_and_returns_the_exit_status(tmp_path, capfd):
    code = ("import sys; print('out line'); sys.stdout.flush(); "
            "print('err line', file=sys.stderr); sys.exit(4)")
    handlers = [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)]
    status = rank_output.run(str(tmp_path), 2, [sys.executable, "-c", code],
                             environ={"PMI_RANK": "1"})
    assert status == 4
    assert [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert (tmp_path / "rank.1" / "stdout").read_text() == "out line\n"
    assert (tmp_path / "rank.1" / "stderr").read_text() == "err line\n"
    console = capfd.readouterr()
    assert "out line" in console.out and "err line" in console.err


def test_wrapper_reports_a_command_that_cannot_start(tmp_path, capfd):
    status = rank_output.run(str(tmp_path), 1, [str(tmp_path / "missing")],
                             environ={"PMI_RANK": "0"})
    assert status == 127
    assert "cannot start" in (tmp_path / "rank.0" / "stderr").read_text()
    assert "cannot start" in capfd.readouterr().err


def test_wrapper_main_usage_and_missing_rank(tmp_path, monkeypatch, capsys):
    assert rank_output.main([str(tmp_path), "x", "cmd"]) == 2
    for name in rank_output.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert rank_output.main([str(tmp_path), "2", "true"]) == 1
    assert "none of PMI_RANK" in capsys.readouterr().err


def test_wrapper_prefixes_each_line_with_horovod_s_timestamp(tmp_path, capfd):
    code = ("import sys; sys.stdout.write('a\\nb\\rc'); sys.stdout.flush(); "
            "print('e', file=sys.stderr)")
    status = rank_output.run(str(tmp_path), 2, [sys.executable, "-c", code],
                             environ={"PMI_RANK": "1"}, timestamps=True)
    assert status == 0
    out = (tmp_path / "rank.1" / "stdout").read_bytes().decode()   # \r kept
    assert re.fullmatch(f"{STAMP}\\[1\\]<stdout>:a\n{STAMP}\\[1\\]<stdout>:b\r"
                        f"{STAMP}\\[1\\]<stdout>:c", out), repr(out)
    assert re.fullmatch(f"{STAMP}\\[1\\]<stderr>:e\n",
                        (tmp_path / "rank.1" / "stderr").read_text())
    console = capfd.readouterr()
    assert console.out == out and re.fullmatch(f"{STAMP}\\[1\\]<stderr>:e\n", console.err)


def test_line_prefixer_keeps_unfinished_lines_until_they_end():
    prefixer = rank_output.LinePrefixer(lambda: b"> ")
    assert prefixer.feed(b"ab") == b""
    assert prefixer.feed(b"c\nd") == b"> abc\n"
    assert prefixer.finish() == b"> d" and prefixer.finish() == b""


def test_wrapper_command_for_timestamps_files_or_both(tmp_path):
    wrap = [sys.executable, "-m", "hvdlite.runner.rank_output"]
    assert horovodrun_flags.wrapper_command(None, False, 2, ["cmd"]) == ["cmd"]
    assert horovodrun_flags.wrapper_command(None, True, 2, ["cmd"]) == wrap + [
        "--prefix-timestamp", "-", "2", "cmd"]
    assert horovodrun_flags.wrapper_command(str(tmp_path), True, 2, ["cmd"]) == wrap + [
        "--prefix-timestamp", str(tmp_path), "2", "cmd"]
    for flag in ("-prefix-timestamp", "--prefix-output-with-timestamp"):
        assert plan(["-np", "2", flag, "cmd"]).command == wrap + [
            "--prefix-timestamp", "-", "2", "cmd"]


def test_wrapper_main_timestamps_without_files(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PMI_RANK", "0")
    assert rank_output.main(["--prefix-timestamp", "-", "1", sys.executable, "-c",
                             "print('x')"]) == 0
    assert re.fullmatch(f"{STAMP}\\[0\\]<stdout>:x\n", capfd.readouterr().out)
    assert list(tmp_path.iterdir()) == []


def test_log_with_timestamp_stamps_hvdlite_s_own_lines(capsys):
    for flags, stamped in ((["--log-with-timestamp"], True), (["--no-log-hide-timestamp"], True),
                           (["--log-without-timestamp"], False), ([], False)):
        assert launch.main(["-np", "2"] + flags) == 2   # no command: hvdlite's error line
        err = capsys.readouterr().err
        assert bool(re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] hvdlite: error: "
                             r"no command given", err)) == stamped, err
    assert launch.main(["-np", "2", "--log-with-timestamp", "--log-hide-timestamp", "c"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_timestamped_lines_leave_other_text_alone():
    sink = io.StringIO()
    stream = horovodrun_flags.TimestampedLines(sink)
    stream.write("rank output\nhvdlite: one")
    stream.write(" line\n")
    text = sink.getvalue()
    assert text.startswith("rank output\n[") and text.endswith("] hvdlite: one line\n")


# --- --thread-affinity --------------------------------------------------------------------------
def test_thread_affinity_flag_exports_the_core_list():
    assert plan(["-np", "2", "--thread-affinity", "3, 1", "cmd"]).env[
        "HVDLITE_THREAD_AFFINITY"] == "3,1"
    assert "HVDLITE_THREAD_AFFINITY" not in plan(["-np", "2", "cmd"]).env
    with pytest.raises(SystemExit):
        launch.parse_args(["-np", "2", "--thread-affinity", "1,x", "cmd"])
    assert horovodrun_flags.THREAD_AFFINITY_VARIABLE == affinity.VARIABLES[0]


@pytest.mark.parametrize("environ,expected", [
    ({}, (None, None)),
    ({"HOROVOD_THREAD_AFFINITY": "4,5", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     (5, None)),
    ({"HVDLITE_THREAD_AFFINITY": "6", "HOROVOD_THREAD_AFFINITY": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, (6, None)),
    ({"HVDLITE_THREAD_AFFINITY": "2"}, (2, None)),   # no launcher: a one-entry list
])
def test_core_for_this_rank(environ, expected):
    assert affinity.core_for_this_rank(environ) == expected


@pytest.mark.parametrize("environ,problem", [
    ({"HVDLITE_THREAD_AFFINITY": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
     "expected 2 core ids (one per local rank), got 1"),
    ({"HVDLITE_THREAD_AFFINITY": "a"}, "'a' is not a core id"),
    ({"HVDLITE_THREAD_AFFINITY": "1,2"}, "no launcher variable gives this process's local rank"),
])
def test_core_for_this_rank_problems_as_horovod_logs_them(environ, problem):
    core, found = affinity.core_for_this_rank(environ)
    assert core is None and problem in found


def test_pin_engine_thread_pins_only_the_calling_thread(caplog):
    core = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    results = []

    def engine_thread():
        results.append(affinity.pin_engine_thread({"HVDLITE_THREAD_AFFINITY": str(core)}))
        results.append(os.sched_getaffinity(threading.get_native_id()))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert results == [core, {core}]
    assert os.sched_getaffinity(0) == before
    assert affinity.pin_engine_thread({"HVDLITE_THREAD_AFFINITY": "x"}) is None
    assert "the engine thread is not pinned" in caplog.text


# --- --tcp --------------------------------------------------------------------------------------
def test_tcp_for_each_flavor():
    spec = plan(["-np", "2", "--tcp", "-x", "FI_PROVIDER=sockets", "cmd"])
    mpi_flavor.apply_tcp(HYDRA, spec)
    assert spec.env["MPIR_CVAR_CH4_NETMOD"] == "ofi" and spec.env["NCCL_IB_DISABLE"] == "1"
    assert spec.env["FI_PROVIDER"] == "sockets"   # -x wins
    env, args = mpi_flavor.tcp_settings(INTEL, [])
    assert env["I_MPI_OFI_PROVIDER"] == env["FI_PROVIDER"] == "tcp" and args == []
    assert mpi_flavor.tcp_settings(OMPI4, [])[1] == ["--mca", "pml", "ob1",
                                                     "--mca", "btl", "tcp,self,vader"]
    assert mpi_flavor.tcp_settings(OMPI5, [])[1][-1] == "tcp,self,sm"
    spec = plan(["-np", "2", "--tcp", "--mpi-args=--mca btl tcp,self", "cmd"])
    mpi_flavor.apply_tcp(OMPI4, spec)
    argv = mpi_flavor.build_command("mpirun", OMPI4, spec)
    assert argv[-7:] == ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "cmd"]


def test_tcp_reaches_the_launcher(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "detect_launcher", lambda explicit: ("mpirun", OMPI4))
    args = launch.parse_args(["-np", "2", "--tcp", "cmd"])
    argv, env = launch.prepare(args, {"PATH": "/usr/bin"}, (), str(tmp_path))
    assert "tcp,self,vader" in argv and env["NCCL_IB_DISABLE"] == "1"
    assert "NCCL_IB_DISABLE" not in launch.prepare(launch.parse_args(["-np", "2", "cmd"]),
                                                   {"PATH": "/usr/bin"}, (), str(tmp_path))[1]


def test_autotune_flags_export_horovod_s_knobs(tmp_path):
    """Each of horovodrun's autotune flags sets its knob for every rank (read under its
    HOROVOD_AUTOTUNE* name too)."""
    log = tmp_path / "tune.csv"
    env = launch.knob_env(launch.parse_args([
        "-np", "2", "--autotune", "--autotune-log-file", str(log),
        "--autotune-warmup-samples", "2", "--autotune-steps-per-sample", "4",
        "--autotune-bayes-opt-max-samples", "9", "--autotune-gaussian-process-noise", "0.5",
        "python", "t.py"]))
    assert env == {"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_LOG": str(log),
                   "HVDLITE_AUTOTUNE_WARMUP_SAMPLES": "2",
                   "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE": "4",
                   "HVDLITE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "9",
                   "HVDLITE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"}
    assert launch.knob_env(launch.parse_args(["-np", "2", "--no-autotune", "python", "t.py"])) \
        == {"HVDLITE_AUTOTUNE": "0"}
    assert not any(flag[0].startswith("--autotune") for flag in horovodrun_flags.UNSUPPORTED)


@pytest.mark.parametrize("flag", ["--autotune-warmup-samples", "--autotune-steps-per-sample",
                                  "--autotune-bayes-opt-max-samples"])
def test_autotune_counts_must_be_whole_non_negative(flag, capsys):
    for bad in ("-1", "2.5"):
        assert launch.main(["-np", "2", "--autotune", flag, bad, "python", "t.py"]) == 2
        assert flag in capsys.readouterr().err
