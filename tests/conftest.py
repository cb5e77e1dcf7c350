"""Test-wide settings: offline hub, no telemetry, loopback-only Ray, a private model cache per session."""

import atexit
import contextlib
import functools
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s by default, so a finished tiny run idles up to 2 s before
# returning; tests run ~100 of them. Read by the controller, which inherits this from the local Ray started here.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# A local Ray without its dashboard starts 2.5 s sooner and polls less; nothing the tests run needs it (the loopback
# test turns it on: users get it by default).
os.environ.setdefault("RAOE_RAY_DASHBOARD", "0")



def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Object storage in the tests is an S3-compatible server on 127.0.0.1 (moto's, started by the ``s3`` fixture when a
# test first needs it), never a real bucket: its address and throwaway keys are set before any Ray starts, so every
# worker of every local Ray reaches it as a cluster's nodes reach S3, through the standard AWS variables.
# (This file is imported twice, as pytest's conftest and as tests.conftest: both must name the same port.)
# Under pytest-xdist (make test runs two workers) each worker is a session of its own: its own S3 server, node cache
# and local Ray, never the ones its controller's environment named.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER and os.environ.get("RAOE_TEST_SESSION") != XDIST_WORKER:
    os.environ["RAOE_TEST_SESSION"] = XDIST_WORKER
    for _key in ("RAOE_TEST_S3_ENDPOINT", "RAOE_NODE_CACHE"):
        os.environ.pop(_key, None)
S3_ENDPOINT = os.environ.setdefault("RAOE_TEST_S3_ENDPOINT", f"http://127.0.0.1:{_free_port()}")
os.environ.update(AWS_ENDPOINT_URL=S3_ENDPOINT, AWS_ACCESS_KEY_ID="raoe-test", AWS_SECRET_ACCESS_KEY="raoe-test",
                  AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
for _key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
    os.environ.pop(_key, None)

ROOT = Path(__file__).resolve().parent.parent
# DeepSpeed compiles a CPU op (25-80 s here) into this folder when it starts on CPU, and rebuilds it when the folder
# changes or was built from another checkout's paths: one folder for the whole session, per checkout (git ignores it).
# data.node_local's per-node copies (a node's own disk; storage/node_cache.py), fresh for each session
if "RAOE_NODE_CACHE" not in os.environ:
    os.environ["RAOE_NODE_CACHE"] = tempfile.mkdtemp(prefix="raoe-node-cache-")
    atexit.register(shutil.rmtree, os.environ["RAOE_NODE_CACHE"], ignore_errors=True)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
DEV_DATA = Path(os.environ.get("RAOE_DEV_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture
def dev_data() -> Path:
    """../shared/data (or RAOE_DEV_DATA); tests that need it skip with a reason on a fresh clone without it."""
    if not DEV_DATA.exists():
        pytest.skip(f"development data not found at {DEV_DATA} (set RAOE_DEV_DATA)")
    return DEV_DATA


@contextlib.contextmanager
def own_ray(num_cpus: int = 2):
    """A local Ray started here, with this moment's environment, for a test whose Ray workers read that environment
    (a sweep's trials log to the test's MLflow store): the shared Ray is shut down rather than joined."""
    import ray

    from runtime.local_ray import ray_session

    if ray.is_initialized():
        ray.shutdown()
    with ray_session(num_cpus=num_cpus):
        yield


def shared_ray() -> None:
    """The local Ray (2 CPUs, loopback) the tests share: joined when up, started when not (the first test to need
    it, or the next one after a test that needed a Ray of its own). Starting one costs ~8 s; jobs and training runs
    join it as they join a cluster. Its workers see the environment of the moment it started: a test's own MLflow
    store reaches Ray Train workers through their runtime env, never through this."""
    import ray

    from runtime.local_ray import start_ray

    if not ray.is_initialized():
        start_ray(num_cpus=2)


def job_module(name: str):
    """A job script of ray_jobs/ imported as a module (its config model and ``main``), as the job tests call them."""
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "ray_jobs"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "ray_jobs"))


@functools.cache
def _empty_mlflow_store() -> Path:
    """This session's empty MLflow store, made (created and migrated) on first use."""
    from mlflow import MlflowClient

    empty = Path(tempfile.mkdtemp(prefix="raoe-empty-mlflow-")) / "mlflow.db"
    atexit.register(shutil.rmtree, empty.parent, ignore_errors=True)
    MlflowClient(f"sqlite:///{empty}").search_experiments()
    return empty


def mlflow_store(folder: Path, name: str = "mlflow.db") -> str:
    """The sqlite URI of a new, empty MLflow store in ``folder``: a copy of one empty store made once a session.
    MLflow makes a new sqlite store by running each of its schema migrations, 1.5-2.5 s of CPU wherever the file is
    first opened (this process, a job's, a Ray worker's), once per test; a copy of an empty migrated store is the
    same store without that. (The job tests that make their own store, test_local_head's, still do.)"""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_empty_mlflow_store(), folder / name)
    return f"sqlite:///{folder / name}"


def private_stores(monkeypatch, tmp_path: Path) -> None:
    """The test's own MLflow store, artifacts and raoe cache."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path))
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))


class S3Bucket:
    """A bucket on the tests' S3 endpoint: ``uri(key)`` names an object, ``upload`` copies a local file or folder."""

    def __init__(self, name: str):
        self.name = name

    def uri(self, key: str) -> str:
        return f"s3://{self.name}/{key}"

    def upload(self, local: Path, key: str) -> str:
        from storage.paths import storage_path

        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for file in files:
            target = key if local.is_file() else f"{key}/{file.relative_to(local).as_posix()}"
            storage_path(self.uri(target)).write_bytes(file.read_bytes())
        return self.uri(key)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on the endpoint the environment names, for the whole session."""
    from urllib.parse import urlparse

    from moto.server import ThreadedMotoServer

    address = urlparse(S3_ENDPOINT)
    server = ThreadedMotoServer(ip_address=address.hostname, port=address.port, verbose=False)
    server.start()
    yield S3_ENDPOINT
    server.stop()


def new_bucket(endpoint: str, label: str) -> S3Bucket:
    """A fresh bucket on the tests' S3 endpoint, named after ``label`` (a test's or a fixture's name)."""
    import re

    import boto3

    name = re.sub(r"[^a-z0-9-]", "-", label.lower())[:50].strip("-") + f"-{_free_port()}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return S3Bucket(name)


@pytest.fixture
def s3(s3_server, request):
    """A fresh bucket for this test on the local S3 endpoint."""
    return new_bucket(s3_server, request.node.name)


@pytest.fixture
def ray_local():
    shared_ray()


SHARED_RAY_USERS = {"ray_local", "train_env"}  # fixtures of tests that run on the shared local Ray


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The shared local Ray is up before any fixture of a test that runs on it, module fixtures that train included:
    after a module that needed a Ray of its own (two nodes, a sweep's, a head), each run would otherwise start and
    stop a Ray of its own (~8 s and a cold worker pool a run). Tests on their own cluster (``two_nodes``) are left
    to it."""
    if SHARED_RAY_USERS & set(item.fixturenames) and "two_nodes" not in item.fixturenames:
        shared_ray()


# make test runs the suite on two pytest-xdist workers (pyproject's addopts), each with its own local Ray: a worker takes
# whole modules (a module's fixtures train once) or whole groups of them, and the costliest go first, so that neither
# worker is left with a long module at the end.
XDIST_GROUPS = {
    # every own_ray module, one after another on one worker: each stops that worker's shared Ray, which starts again
    # once after them instead of after each
    "tests/foundation/test_local_head.py": "own-ray",
    "tests/foundation/test_local_ray.py": "own-ray",
    "tests/training/test_multinode.py": "own-ray",
    "tests/tuning/test_sweep.py": "own-ray",
    "tests/cluster/test_autoscaled_head.py": "own-ray",
    # both check the one run of tests/training/conftest.py::simcse_retrieval_dev_run
    "tests/training/test_simcse_training.py": "simcse-retrieval-dev-run",
    "tests/training/test_dev_selection.py": "simcse-retrieval-dev-run",
}
# Seconds each took on one of two workers on this 2-core machine (2026-11-28); the rest follow in collection order.
COSTLIEST_FIRST = {
    "own-ray": 370,  # 2026-12-08: the node of its own (test_multinode) and the autoscaled head added ~130 s
    "tests/data_pipelines/test_mining.py": 190,
    "tests/training/test_distributed.py": 183,
    "tests/evaluation/test_retrieval.py": 153,
    "tests/training/test_posttrain.py": 129,
    "tests/training/test_relational.py": 97,
    "tests/training/test_exact_resume.py": 94,
    "tests/training/test_recovery_and_registry.py": 86,
    "tests/data_pipelines/test_annotate.py": 75,
    "tests/training/test_unsupervised.py": 71,
    "tests/data_pipelines/test_embed.py": 62,
    "tests/data_pipelines/test_ranked_decoding.py": 43,
    "tests/training/test_exact_batch.py": 37,
}


def xdist_unit(nodeid: str) -> str:
    """What one xdist worker runs whole: the test's group, else its module."""
    module = nodeid.split("::", 1)[0]
    return XDIST_GROUPS.get(module, module)


def pytest_collection_modifyitems(session, config, items):
    """Modules marked ``own_ray`` stop the shared local Ray (a head of their own, two nodes, a sweep's Ray, the
    loopback test). In one process they run after every other test, in their order: the shared Ray then starts once a
    session and keeps its warm worker pool, instead of starting again (~8 s, and cold Pythons for the next Ray Data
    operators) after each of them. On xdist workers they are one unit (XDIST_GROUPS), and units go costliest first."""
    unlisted = sorted({item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("own_ray")
                       and xdist_unit(item.nodeid) != "own-ray"})
    if unlisted:
        raise pytest.UsageError(f"marked own_ray but not in tests/conftest.py's XDIST_GROUPS: {', '.join(unlisted)}")
    if XDIST_WORKER:
        rank = {unit: n for n, unit in enumerate(COSTLIEST_FIRST)}
        order = {id(item): n for n, item in enumerate(items)}
        items.sort(key=lambda item: (rank.get(xdist_unit(item.nodeid), len(rank)), order[id(item)]))
        return
    last = [item for item in items if item.get_closest_marker("own_ray")]
    if last:
        items[:] = [item for item in items if not item.get_closest_marker("own_ray")] + last


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole units (xdist_unit) per worker, in the order the workers collected them (costliest first). xdist's own
    ``loadgroup`` marks groups by renaming nodeids, which pytest 9 no longer lets a plugin do."""
    if config.getvalue("dist") != "loadscope":
        return None  # another --dist asked for on the command line: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class WholeUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    config.option.loadscopereorder = False
    return WholeUnits(config, log)


# A test over 30 s (its call, or the set-up of the module fixtures it is the first to use) says why in its docstring,
# or in that fixture's: a cost in seconds, e.g. "About 60 s: four actor pools start". Timings differ between
# machines, so this is reported under the run's durations, never failed on.
SLOW_S = 30.0
COST_SAID = re.compile(r"\d\s?(?:s|seconds|minutes?)\b")


def _says_its_cost(item, when: str) -> bool:
    docs = [getattr(getattr(item, "function", None), "__doc__", None)]
    fixtures = getattr(item, "_fixtureinfo", None)  # a test function's (pytest's own record of its fixtures)
    if when == "setup" and fixtures is not None:
        docs += [definition.func.__doc__ for definitions in fixtures.name2fixturedefs.values()
                 for definition in definitions]
    return any(COST_SAID.search(doc) for doc in docs if doc)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when in ("setup", "call") and call.duration > SLOW_S and not _says_its_cost(item, call.when):
        report.user_properties.append(("slow_without_a_reason", call.when))  # reaches xdist's controller


_SLOW_WITHOUT_A_REASON: list[str] = []


def pytest_runtest_logreport(report):
    if any(name == "slow_without_a_reason" for name, _ in report.user_properties):
        _SLOW_WITHOUT_A_REASON.append(f"{report.duration:.1f}s {report.when} {report.nodeid}")


def pytest_terminal_summary(terminalreporter):
    if _SLOW_WITHOUT_A_REASON:
        terminalreporter.section(f"over {SLOW_S:.0f} s without saying why in a docstring (the test's or its fixture's)")
        for line in _SLOW_WITHOUT_A_REASON:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_stops_at_the_end():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


SHIPPED_CONFIG = '''import pathlib
from transformers import {config_base}
pathlib.Path({marker!r}).write_text("ran")


class RaoeConfig({config_base}):
    model_type = "raoe-{name}"
'''
SHIPPED_MODEL = '''from transformers import {model_base}
from .configuration_raoe import RaoeConfig


class RaoeModel({model_base}):
    config_class = RaoeConfig
'''


@pytest.fixture
def shipped_code_model(tmp_path):
    """Factory: a copy of a tiny model whose architecture is Python code in its folder (``auto_map``); importing
    that code writes the returned marker file, so a test sees whether it ran. Folder names are unique because
    transformers caches shipped modules by folder name."""
    import json
    import shutil

    from encoders.sources import resolve_model_source

    def make(source: str, config_base: str, model_base: str, auto_class: str = "AutoModel") -> tuple[Path, Path]:
        name = f"shipped_{tmp_path.name}_{model_base}".lower().replace("-", "_")
        folder, marker = tmp_path / name, tmp_path / f"{name}.ran"
        shutil.copytree(resolve_model_source(source), folder)
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type=f"raoe-{name}", architectures=["RaoeModel"],
                      auto_map={"AutoConfig": "configuration_raoe.RaoeConfig", auto_class: "modeling_raoe.RaoeModel"})
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "configuration_raoe.py").write_text(SHIPPED_CONFIG.format(config_base=config_base,
                                                                            marker=str(marker), name=name))
        (folder / "modeling_raoe.py").write_text(SHIPPED_MODEL.format(model_base=model_base))
        return folder, marker

    return make
