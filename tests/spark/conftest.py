"""Spark for the tests: one Spark session at a time, shared by every test that asks for the same
master (starting one costs about 10 s), on loopback only.

``spark_cluster``: ``local-cluster[2,1,1024]``, a standalone master and two workers inside the
driver's JVM, each with one executor JVM of its own (one core): executors that can be killed
one at a time.  ``spark_local3``: ``local[3]``, every task a thread of the driver's JVM (with
its own Python worker).  Asking for the other master stops the running session first, so the
test modules keep to one of them each.

Every Spark job a test starts runs under :func:`bounded`, which cancels it (Spark kills its
tasks, and with them the ranks they started) when it runs past its time.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading

import pytest


def _missing() -> str | None:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "PySpark is not installed (pip install hvdlite[spark])"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java runtime (Spark needs Java 17+)"
    return None


def require_spark() -> None:
    """Skip the test when PySpark or Java is missing; fail it instead under .ci/run, which
    installs both (HVDLITE_TEST_REQUIRE_SPARK=1)."""
    missing = _missing()
    if missing is None:
        return
    if os.environ.get("HVDLITE_TEST_REQUIRE_SPARK") == "1":
        pytest.fail(f"tests/spark: {missing} (HVDLITE_TEST_REQUIRE_SPARK=1)", pytrace=False)
    pytest.skip(f"tests/spark: {missing}", allow_module_level=True)


CLUSTER_MASTER = "local-cluster[2,1,1024]"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_state: dict = {"session": None, "master": None}
_work_dir = tempfile.mkdtemp(prefix="hvdlite-spark-work-")


def session_for(master: str):
    """The shared session on ``master`` (stopping one on another master first)."""
    require_spark()
    from pyspark.sql import SparkSession
    if _state["master"] == master:
        return _state["session"]
    stop_session()
    # Only loopback: Spark binds to the machine's network address unless told otherwise, and the
    # standalone workers of local-cluster keep their files under SPARK_WORKER_DIR.
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["SPARK_WORKER_DIR"] = _work_dir
    os.environ.setdefault("PYSPARK_PYTHON", os.sys.executable)
    # The tests' functions (tests.*) travel by reference: the executors import them too.
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = path
    builder = (SparkSession.builder.master(master).appName("hvdlite-tests")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.executorEnv.OMP_NUM_THREADS", "1")
               .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
               .config("spark.executorEnv.PYTHONPATH", path)
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "4"))
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    _state.update(session=session, master=master)
    return session


def stop_session() -> None:
    session = _state["session"]
    _state.update(session=None, master=None)
    if session is not None:
        session.stop()


@pytest.fixture(scope="package", autouse=True)
def _stop_at_end():
    """The session's JVMs (driver, workers, executors) end with tests/spark, not with the
    whole test run, whose later tests need the memory and cores."""
    yield
    stop_session()
    shutil.rmtree(_work_dir, ignore_errors=True)


@pytest.fixture
def spark_cluster():
    """A SparkSession on ``local-cluster[2,1,1024]`` (two executor JVMs, one slot each)."""
    return session_for(CLUSTER_MASTER)


@pytest.fixture
def spark_local3():
    """A SparkSession on ``local[3]`` (three slots in the driver's JVM)."""
    return session_for("local[3]")


def bounded(session, call, timeout_s: float = 240.0):
    """``call()``'s value; when it runs past ``timeout_s``, cancel every Spark job it started
    (their tasks are killed) and fail the test."""
    sc = session.sparkContext
    group = f"hvdlite-test-{threading.get_ident()}-{os.urandom(4).hex()}"
    box: dict = {}

    def target():
        sc.setJobGroup(group, "hvdlite test", interruptOnCancel=True)
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        sc.cancelJobGroup(group)
        worker.join(30)
        pytest.fail(f"the Spark job ran past {timeout_s:g} s and was cancelled")
    if "error" in box:
        raise box["error"]
    return box["value"]
