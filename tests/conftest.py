import os
from pathlib import Path

import pytest
import torch

from tests import tiny

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


@pytest.fixture(scope="session")
def default_model(home):
    """The real default model (SmolLM2-135M-Instruct), from the user's prepared cache."""
    from services.common.loading import load_model

    old = os.environ.pop("SPECSERVE_HOME")  # use the cache `make setup` prepared
    try:
        return load_model("default")
    finally:
        os.environ["SPECSERVE_HOME"] = old
