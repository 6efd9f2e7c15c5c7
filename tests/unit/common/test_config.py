"""config.Config.from_env: defaults, HVDLITE_ over HOROVOD_ aliases, bad values; and the knob
table (config.KNOBS) that declares every knob once (pure logic)."""
import dataclasses
import typing

import pytest

from hvdlite.common import config as config_module
from hvdlite.common.runtime.lifecycle import settings_error as _settings_error
from hvdlite.common.config import KNOB_BY_NAME, KNOBS, OWN, RANK0, RECORDER, Config


def test_defaults_from_empty_environment():
    cfg = Config.from_env({})
    assert cfg.fusion_threshold == 128 * 1024 * 1024
    assert cfg.cache_capacity == 1024
    assert cfg.cycle_time_ms == 1.0
    assert cfg.stall_check_enabled is True
    assert cfg.stall_check_seconds == 60.0
    assert cfg.stall_shutdown_seconds == 0.0
    assert cfg.log_level == "WARNING"
    assert cfg.result_pool_bytes == 512 * 2**20
    assert cfg.shm_window_bytes == 64 * 2**20
    assert cfg.direct_copies == "auto"
    assert cfg.gradient_bucket_bytes == 25 * 2**20
    assert cfg.dynamic_process_sets is False
    assert cfg.gpu_operations == "nccl" and cfg.gpu_async_completion is True
    assert cfg.timeline_filename is None and cfg.timeline_mark_cycles is False
    assert cfg == Config()


@pytest.mark.parametrize("knob,field,raw,value", [
    ("FUSION_THRESHOLD", "fusion_threshold", "4096", 4096),
    ("FUSION_THRESHOLD", "fusion_threshold", "0", 0),
    ("CACHE_CAPACITY", "cache_capacity", "0", 0),
    ("CACHE_CAPACITY", "cache_capacity", "7", 7),
    ("CYCLE_TIME", "cycle_time_ms", "2.5", 2.5),
    ("STALL_CHECK_TIME_SECONDS", "stall_check_seconds", "1", 1.0),
    ("STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_seconds", "2.5", 2.5),
    ("LOG_LEVEL", "log_level", "debug", "DEBUG"),
    ("RESULT_POOL_MB", "result_pool_bytes", "1.5", 3 * 2**19),
    ("RESULT_POOL_MB", "result_pool_bytes", "0", 0),
    ("SHM_WINDOW_MB", "shm_window_bytes", "16", 16 * 2**20),
    ("SHM_WINDOW_MB", "shm_window_bytes", "0", 0),
    ("DIRECT_COPIES", "direct_copies", "0", "off"),
    ("DIRECT_COPIES", "direct_copies", "off", "off"),
    ("DIRECT_COPIES", "direct_copies", "1", "on"),
    ("DIRECT_COPIES", "direct_copies", "TRUE", "on"),
    ("DIRECT_COPIES", "direct_copies", "auto", "auto"),
    ("GRADIENT_BUCKET_MB", "gradient_bucket_bytes", "4", 4 * 2**20),
    ("GRADIENT_BUCKET_MB", "gradient_bucket_bytes", "0.5", 2**19),
    ("GRADIENT_BUCKET_MB", "gradient_bucket_bytes", "0", 0),
])
@pytest.mark.parametrize("prefix", ["HVDLITE_", "HOROVOD_"])
def test_each_knob_under_both_prefixes(knob, field, raw, value, prefix):
    cfg = Config.from_env({prefix + knob: raw})
    assert getattr(cfg, field) == value
    assert type(getattr(cfg, field)) is type(value)


@pytest.mark.parametrize("knob,field,ours,theirs,value", [
    ("FUSION_THRESHOLD", "fusion_threshold", "1024", "2048", 1024),
    ("CACHE_CAPACITY", "cache_capacity", "0", "100", 0),
    ("STALL_CHECK_TIME_SECONDS", "stall_check_seconds", "5", "30", 5.0),
    ("STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_seconds", "9", "1", 9.0),
    ("LOG_LEVEL", "log_level", "error", "debug", "ERROR"),
])
def test_hvdlite_spelling_wins_over_horovod(knob, field, ours, theirs, value):
    env = {"HOROVOD_" + knob: theirs, "HVDLITE_" + knob: ours}
    assert getattr(Config.from_env(env), field) == value
    assert KNOB_BY_NAME[knob].lookup(env) == ("HVDLITE_" + knob, ours)


def test_lookup_unset():
    knob = KNOB_BY_NAME["FUSION_THRESHOLD"]
    assert knob.lookup({}) is None
    assert knob.lookup({"OTHER_FUSION_THRESHOLD": "1"}) is None


def test_empty_hvdlite_value_counts_as_unset():
    knob = KNOB_BY_NAME["FUSION_THRESHOLD"]
    env = {"HVDLITE_FUSION_THRESHOLD": "  ", "HOROVOD_FUSION_THRESHOLD": " 64 "}
    assert knob.lookup(env) == ("HOROVOD_FUSION_THRESHOLD", "64")
    assert Config.from_env(env).fusion_threshold == 64
    assert Config.from_env({"HVDLITE_TIMELINE": ""}).timeline_filename is None


def test_reads_os_environ_by_default(monkeypatch):
    for key in ("HVDLITE_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD",
                "HVDLITE_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "333")
    monkeypatch.setenv("HVDLITE_CACHE_CAPACITY", "5")
    cfg = Config.from_env()
    assert cfg.fusion_threshold == 333 and cfg.cache_capacity == 5


@pytest.mark.parametrize("raw,enabled", [("1", False), ("true", False), ("yes", False),
                                         ("0", True), ("false", True), ("off", True)])
def test_stall_check_disable_flag(raw, enabled):
    assert Config.from_env({"HVDLITE_STALL_CHECK_DISABLE": raw}).stall_check_enabled is enabled
    assert Config.from_env({"HOROVOD_STALL_CHECK_DISABLE": raw}).stall_check_enabled is enabled


@pytest.mark.parametrize("knob", ["FUSION_THRESHOLD", "CACHE_CAPACITY", "CYCLE_TIME",
                                  "STALL_CHECK_TIME_SECONDS", "STALL_SHUTDOWN_TIME_SECONDS",
                                  "RESULT_POOL_MB", "GRADIENT_BUCKET_MB"])
@pytest.mark.parametrize("raw", ["abc", "12MB", "-1", "1..2"])
@pytest.mark.parametrize("prefix", ["HVDLITE_", "HOROVOD_"])
def test_bad_values_raise(knob, raw, prefix):
    with pytest.raises(ValueError) as info:
        Config.from_env({prefix + knob: raw})
    assert knob in str(info.value), f"error does not name the knob: {info.value}"


def test_bad_hvdlite_value_not_hidden_by_good_alias():
    with pytest.raises(ValueError):
        Config.from_env({"HVDLITE_FUSION_THRESHOLD": "lots", "HOROVOD_FUSION_THRESHOLD": "64"})


def test_config_is_immutable():
    cfg = Config.from_env({})
    with pytest.raises(Exception):
        cfg.fusion_threshold = 1


@pytest.mark.parametrize("cycle_ms,cycle_seconds,sleep_cap", [
    (1.0, 1e-3, 1e-3),
    (0.2, 2e-4, 2e-4),      # a shorter cycle also wakes waits sooner
    (0.0, 1e-5, 1e-5),      # floor: a zero cycle must not make waits spin
    (500.0, 0.5, 1e-3),     # a long cycle gathers longer but must not make waits sleep longer
])
def test_cycle_time_and_wait_sleep_cap(cycle_ms, cycle_seconds, sleep_cap):
    cfg = Config.from_env({"HVDLITE_CYCLE_TIME": str(cycle_ms)})
    assert cfg.cycle_seconds == pytest.approx(cycle_seconds)
    assert cfg.wait_sleep_cap == pytest.approx(sleep_cap)


@pytest.mark.parametrize("raw", ["2.5", "maybe", "cma"])
def test_bad_cma_mode_raises(raw):
    with pytest.raises(ValueError, match="HVDLITE_DIRECT_COPIES") as info:
        Config.from_env({"HVDLITE_DIRECT_COPIES": raw})
    assert "auto" in str(info.value)


# --- on/off knobs: a typo is an error, not a silent choice ------------------------------------
SWITCHES = [("STALL_CHECK_DISABLE", "stall_check_enabled", False),   # (knob, field, field if on)
            ("DYNAMIC_PROCESS_SETS", "dynamic_process_sets", True),
            ("ENABLE_ASYNC_COMPLETION", "gpu_async_completion", True),
            ("TIMELINE_MARK_CYCLES", "timeline_mark_cycles", True)]


@pytest.mark.parametrize("knob,field,when_on", SWITCHES)
@pytest.mark.parametrize("raw,on", [("1", True), ("TRUE", True), ("yes", True), ("On", True),
                                    ("0", False), ("false", False), ("NO", False), ("off", False),
                                    ("2", True), ("-1", False)])   # integers as Horovod reads them
@pytest.mark.parametrize("prefix", ["HVDLITE_", "HOROVOD_"])
def test_switches_read_on_off_words(knob, field, when_on, raw, on, prefix):
    assert getattr(Config.from_env({prefix + knob: raw}), field) is (when_on if on else
                                                                      not when_on)


@pytest.mark.parametrize("knob", [k for k, _, _ in SWITCHES] + ["CMA"])
@pytest.mark.parametrize("raw", ["maybe", "enable", "1.5", "0x1"])
@pytest.mark.parametrize("prefix", ["HVDLITE_", "HOROVOD_"])
def test_switches_refuse_other_words_naming_the_variable_set(knob, raw, prefix):
    with pytest.raises(ValueError) as info:
        Config.from_env({prefix + knob: raw})
    assert f"{prefix}{knob}={raw!r} is not understood" in str(info.value)
    assert "1 or 0" in str(info.value)


@pytest.mark.parametrize("raw,on", [(None, False), ("1", True), ("off", False)])
def test_timeline_mark_cycles(raw, on):
    env = {} if raw is None else {"HOROVOD_TIMELINE_MARK_CYCLES": raw}
    assert Config.from_env(env).timeline_mark_cycles is on


def test_timeline_mark_cycles_refuses_other_words():
    with pytest.raises(ValueError, match="HVDLITE_TIMELINE_MARK_CYCLES='sure'"):
        Config.from_env({"HVDLITE_TIMELINE_MARK_CYCLES": "sure"})


def test_number_errors_name_the_horovod_variable_when_that_is_the_one_set():
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='64MB' is not a finite number"):
        Config.from_env({"HOROVOD_FUSION_THRESHOLD": "64MB"})
    with pytest.raises(ValueError, match="HOROVOD_GPU_OPERATIONS='gloo' is not one of"):
        Config.from_env({"HOROVOD_GPU_OPERATIONS": "gloo"})


@pytest.mark.parametrize("name", ["FUSION_THRESHOLD", "CACHE_CAPACITY", "CYCLE_TIME",
                                  "STALL_SHUTDOWN_TIME_SECONDS", "GRADIENT_BUCKET_MB"])
@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "1e999"])
def test_numbers_must_be_finite(name, raw):
    # An OverflowError (int knobs) would escape init()'s all-ranks settings check and hang
    # the other ranks; nan/inf mean no setting.
    with pytest.raises(ValueError, match=f"HVDLITE_{name}='{raw}' is not a finite number"):
        Config.from_env({f"HVDLITE_{name}": raw})


@pytest.mark.parametrize("raw, level", [("trace", "DEBUG"), ("Debug", "DEBUG"), ("info", "INFO"),
                                        ("WARNING", "WARNING"), ("error", "ERROR"),
                                        ("fatal", "CRITICAL"), ("critical", "CRITICAL")])
def test_log_level_names(raw, level):
    assert Config.from_env({"HOROVOD_LOG_LEVEL": raw}).log_level == level


def test_log_level_typo_is_a_settings_error():
    # Checked with every other knob in init(): before, logging.setLevel raised on that rank only,
    # after the all-ranks settings check, and the other ranks waited for it.
    with pytest.raises(ValueError, match="HVDLITE_LOG_LEVEL='verbose' is not a log level"):
        Config.from_env({"HVDLITE_LOG_LEVEL": "verbose"})


def test_settings_error_names_the_problem_and_the_ranks():
    problems = (None, "HVDLITE_DIRECT_COPIES='x' is not understood.", None, "HVDLITE_DIRECT_COPIES='x' is not "
                "understood.")
    own = _settings_error(problems, 1)
    assert own.startswith("hvd.init(): HVDLITE_DIRECT_COPIES='x' is not understood (rank 1). ")
    assert "Invalid settings on ranks [1, 3]" in own
    other = _settings_error(problems, 0)
    assert "rank 1's settings are invalid: HVDLITE_DIRECT_COPIES='x' is not understood." in other
    assert "Invalid settings on ranks [1, 3]" in other and "start the job again" in other


# --- the knob table: every knob declared once -----------------------------------------------
# One non-default setting per knob and the Config value it must give, written out by hand (not
# from the table): a knob added to the table without a line here fails test_every_knob_has_a_
# round_trip_case.
ROUND_TRIPS = {
    "FUSION_THRESHOLD": ("fusion_threshold", "1e3", 1000),
    "CYCLE_TIME": ("cycle_time_ms", "0.25", 0.25),
    "CACHE_CAPACITY": ("cache_capacity", "9", 9),
    "STALL_CHECK_TIME_SECONDS": ("stall_check_seconds", "7.5", 7.5),
    "STALL_SHUTDOWN_TIME_SECONDS": ("stall_shutdown_seconds", "30", 30.0),
    "STALL_CHECK_DISABLE": ("stall_check_enabled", "1", False),
    "LOG_LEVEL": ("log_level", "Info", "INFO"),
    "START_TIMEOUT": ("start_timeout_seconds", "5", 5.0),
    "DYNAMIC_PROCESS_SETS": ("dynamic_process_sets", "yes", True),
    "GPU_OPERATIONS": ("gpu_operations", "MPI", "mpi"),
    "ENABLE_ASYNC_COMPLETION": ("gpu_async_completion", "0", False),
    "SHM_WINDOW_MB": ("shm_window_bytes", "0.25", 2**18),
    "DIRECT_COPIES": ("direct_copies", "off", "off"),
    "TIMELINE": ("timeline_filename", " /tmp/tl.json ", "/tmp/tl.json"),
    "TIMELINE_MARK_CYCLES": ("timeline_mark_cycles", "on", True),
    "GRADIENT_BUCKET_MB": ("gradient_bucket_bytes", "2", 2 * 2**20),
    "RESULT_POOL_MB": ("result_pool_bytes", "3", 3 * 2**20),
    "HIERARCHICAL_ALLREDUCE": ("hierarchical_allreduce", "0", False),
    "HIERARCHICAL_ALLGATHER": ("hierarchical_allgather", "true", True),
    "EARLY_REDUCTIONS": ("early_reductions", "0", False),
    "WATCHDOG": ("watchdog", "0", False),
    "WATCHDOG_PORT": ("watchdog_port", "29511", 29511),
    "AUTOTUNE": ("autotune", "1", True),
    "AUTOTUNE_LOG": ("autotune_log", "/tmp/tune.csv", "/tmp/tune.csv"),
    "AUTOTUNE_WARMUP_SAMPLES": ("autotune_warmup_samples", "5", 5),
    "AUTOTUNE_STEPS_PER_SAMPLE": ("autotune_steps_per_sample", "20", 20),
    "AUTOTUNE_BAYES_OPT_MAX_SAMPLES": ("autotune_bayes_opt_max_samples", "50", 50),
    "AUTOTUNE_GAUSSIAN_PROCESS_NOISE": ("autotune_gaussian_process_noise", "0.9", 0.9),
}


def test_every_knob_has_a_round_trip_case():
    assert set(ROUND_TRIPS) == {knob.name for knob in KNOBS}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("prefix", ["HVDLITE_", "HOROVOD_"])
def test_every_knob_round_trips_from_env_to_config(name, prefix):
    field, raw, value = ROUND_TRIPS[name]
    knob = KNOB_BY_NAME[name]
    assert knob.field == field and (knob.variable, knob.alias) == ("HVDLITE_" + name,
                                                                   "HOROVOD_" + name)
    cfg = Config.from_env({prefix + name: raw})
    assert getattr(cfg, field) == value and type(getattr(cfg, field)) is type(value)
    assert getattr(Config(), field) != value, "the case must differ from the default"
    # only this field moved
    assert dataclasses.replace(cfg, **{field: getattr(Config(), field)}) == Config()


def test_knob_names_and_fields_are_unique():
    assert len({knob.name for knob in KNOBS}) == len(KNOBS)
    assert len({knob.field for knob in KNOBS}) == len(KNOBS)
    assert set(KNOB_BY_NAME) == {knob.name for knob in KNOBS}


def test_every_config_field_is_fed_by_a_knob():
    """A Config field that no knob feeds (or a knob naming a field Config lacks) fails here."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert set(fields) == {knob.field for knob in KNOBS}
    hints = typing.get_type_hints(Config)
    for knob in KNOBS:   # the field's default and type are the knob's
        assert fields[knob.field].default == knob.field_default, knob.name
        default = knob.field_default
        allowed = typing.get_args(hints[knob.field]) or (hints[knob.field],)
        assert type(default) in allowed, (knob.name, hints[knob.field], default)


def test_every_knob_is_documented():
    """A knob without help text, whose-value column, Horovod column or a broken flag cannot be
    added: the help is what --help, the error messages and the docs say about it."""
    for knob in KNOBS:
        assert knob.help.strip() and knob.help == knob.help.strip(), knob.name
        assert not knob.help.endswith("."), f"{knob.name}: the docs add their own full stop"
        assert knob.agree in (RANK0, OWN, RECORDER), knob.name
        assert knob.horovod.strip(), knob.name
        assert knob.kind.type_name, knob.name
        for flag in knob.flags:
            assert flag.spellings and all(s.startswith("-") for s in flag.spellings), knob.name
            if flag.sets is not None:
                assert flag.help.strip(), f"{knob.name}: on/off flag {flag.spellings} has no help"
            else:
                assert flag.metavar, f"{knob.name}: {flag.spellings} needs a metavar"


def test_a_knob_has_one_value_flag_or_on_off_flags():
    """hvdlite run stores all flags of a knob under one name (see launch._add_knob_options)."""
    for knob in KNOBS:
        kinds = {flag.sets is None for flag in knob.flags}
        assert len(kinds) <= 1, knob.name
        if True in kinds:
            assert len(knob.flags) == 1, knob.name


def test_whose_value_counts_is_as_init_uses_it():
    """init(): rank 0's values everywhere, but each rank's own memory and log level (and the
    start timeout, read before the world exists); the timeline and the autotune log are rank
    0's alone (only rank 0 writes them)."""
    assert {k.name for k in KNOBS if k.agree == OWN} == {"LOG_LEVEL", "RESULT_POOL_MB",
                                                          "START_TIMEOUT"}
    assert {k.name for k in KNOBS if k.agree == RECORDER} == {"TIMELINE",
                                                              "TIMELINE_MARK_CYCLES",
                                                              "AUTOTUNE_LOG"}
    rank0 = Config.from_env({"HVDLITE_FUSION_THRESHOLD": "1", "HVDLITE_LOG_LEVEL": "debug",
                             "HVDLITE_RESULT_POOL_MB": "1", "HVDLITE_TIMELINE": "/tmp/a"})
    own = Config.from_env({"HVDLITE_FUSION_THRESHOLD": "2", "HVDLITE_LOG_LEVEL": "error",
                           "HVDLITE_RESULT_POOL_MB": "2", "HVDLITE_DIRECT_COPIES": "0"})
    used = own.with_rank0(rank0)
    assert (used.fusion_threshold, used.direct_copies, used.timeline_filename) == (1, "auto", "/tmp/a")
    assert (used.log_level, used.result_pool_bytes) == ("ERROR", 2 * 2**20)
    assert rank0.with_rank0(rank0) == rank0


def test_result_pool_default_is_the_table_s():
    assert config_module.DEFAULT_RESULT_POOL_MB == 512
    from hvdlite.common import memory
    assert memory.POOL_MAX_IDLE_BYTES == Config().result_pool_bytes


def test_switch_errors_say_what_the_knob_does():
    with pytest.raises(ValueError) as info:
        Config.from_env({"HOROVOD_STALL_CHECK_DISABLE": "maybe"})
    assert str(info.value) == ("HOROVOD_STALL_CHECK_DISABLE='maybe' is not understood; use 1 "
                               "or 0 (1 turns the stall inspector off).")
    with pytest.raises(ValueError, match=r"HVDLITE_DIRECT_COPIES='x' is not understood; use "
                                         r"auto, 1 or 0 \(auto: single allreduces"):
        Config.from_env({"HVDLITE_DIRECT_COPIES": "x"})
    with pytest.raises(ValueError, match=r"is not one of nccl, mpi \(nccl: reduce GPU tensors"):
        Config.from_env({"HVDLITE_GPU_OPERATIONS": "gloo"})


def test_config_module_imports_only_the_standard_library():
    """The docs build loads config.py and knob_kinds.py on their own (scripts/mkdocs_knobs.py):
    config.py may import the standard library and knob_kinds, knob_kinds the standard library
    (and config itself, for type checking only)."""
    import ast
    import sys
    from hvdlite.common import knob_kinds
    allowed = {config_module: {"__future__", "hvdlite.common.knob_kinds"},
               knob_kinds: {"__future__", "hvdlite.common.config"}}
    for module, extra in allowed.items():
        tree = ast.parse(open(module.__file__, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0 and node.module.split(".")[0] in sys.stdlib_module_names \
                    or node.module in extra, ast.dump(node)
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names)


@pytest.mark.parametrize("old, field, raw, value", [
    ("HVDLITE_SHM_FUSION_MB", "shm_window_bytes", "16", 16 * 2**20),
    ("HOROVOD_SHM_FUSION_MB", "shm_window_bytes", "0", 0),
    ("HVDLITE_CMA", "direct_copies", "0", "off"),
    ("HOROVOD_CMA", "direct_copies", "1", "on"),
])
def test_old_knob_names_still_work(old, field, raw, value):
    """SHM_FUSION_MB and CMA were renamed SHM_WINDOW_MB and DIRECT_COPIES (one name per
    concept); scripts that set the old names keep their effect."""
    assert getattr(Config.from_env({old: raw}), field) == value
    assert getattr(Config(), field) != value   # the defaults differ: the old name did this


@pytest.mark.parametrize("new, old, field", [
    ("HVDLITE_SHM_WINDOW_MB", "HVDLITE_SHM_FUSION_MB", "shm_window_bytes"),
    ("HVDLITE_DIRECT_COPIES", "HVDLITE_CMA", "direct_copies"),
])
def test_the_new_knob_name_wins_over_the_old(new, old, field):
    cfg = Config.from_env({new: "0", old: "1"})
    assert getattr(cfg, field) == (0 if field == "shm_window_bytes" else "off")


def test_an_old_knob_name_is_named_in_errors():
    with pytest.raises(ValueError, match="HVDLITE_CMA"):
        Config.from_env({"HVDLITE_CMA": "x"})
