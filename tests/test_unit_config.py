"""config.Config.from_env: defaults, HVDLITE_ over HOROVOD_ aliases, bad values (pure logic)."""
import pytest

from hvdlite.common.basics import _settings_error
from hvdlite.common.config import Config, env_flag, env_value


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
    assert cfg.shm_fusion_bytes == 64 * 2**20
    assert cfg.cma == "auto"
    assert cfg.gradient_bucket_bytes == 25 * 2**20
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
    ("SHM_FUSION_MB", "shm_fusion_bytes", "16", 16 * 2**20),
    ("SHM_FUSION_MB", "shm_fusion_bytes", "0", 0),
    ("CMA", "cma", "0", "off"),
    ("CMA", "cma", "off", "off"),
    ("CMA", "cma", "1", "on"),
    ("CMA", "cma", "TRUE", "on"),
    ("CMA", "cma", "auto", "auto"),
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
    assert env_value(knob, env) == ours


def test_env_value_unset():
    assert env_value("FUSION_THRESHOLD", {}) is None
    assert env_value("FUSION_THRESHOLD", {"OTHER_FUSION_THRESHOLD": "1"}) is None


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
    with pytest.raises(ValueError, match="HVDLITE_CMA") as info:
        Config.from_env({"HVDLITE_CMA": raw})
    assert "auto" in str(info.value)


# --- on/off knobs: a typo is an error, not a silent choice ------------------------------------
SWITCHES = [("STALL_CHECK_DISABLE", "stall_check_enabled", False),   # (knob, field, field if on)
            ("DYNAMIC_PROCESS_SETS", "dynamic_process_sets", True),
            ("ENABLE_ASYNC_COMPLETION", "gpu_async_completion", True)]


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
def test_env_flag(raw, on):
    env = {} if raw is None else {"HOROVOD_TIMELINE_MARK_CYCLES": raw}
    assert env_flag("TIMELINE_MARK_CYCLES", env) is on


def test_env_flag_refuses_other_words():
    with pytest.raises(ValueError, match="HVDLITE_TIMELINE_MARK_CYCLES='sure'"):
        env_flag("TIMELINE_MARK_CYCLES", {"HVDLITE_TIMELINE_MARK_CYCLES": "sure"})


def test_number_errors_name_the_horovod_variable_when_that_is_the_one_set():
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='64MB' is not a number"):
        Config.from_env({"HOROVOD_FUSION_THRESHOLD": "64MB"})
    with pytest.raises(ValueError, match="HOROVOD_GPU_OPERATIONS='gloo' is not one of"):
        Config.from_env({"HOROVOD_GPU_OPERATIONS": "gloo"})


def test_settings_error_names_the_problem_and_the_ranks():
    problems = (None, "HVDLITE_CMA='x' is not understood.", None, "HVDLITE_CMA='x' is not "
                "understood.")
    own = _settings_error(problems, 1)
    assert own.startswith("hvd.init(): HVDLITE_CMA='x' is not understood (rank 1). ")
    assert "Invalid settings on ranks [1, 3]" in own
    other = _settings_error(problems, 0)
    assert "rank 1's settings are invalid: HVDLITE_CMA='x' is not understood." in other
    assert "Invalid settings on ranks [1, 3]" in other and "start the job again" in other
