"""Tiny random Hugging Face checkpoints of each supported family, saved once per test session
(fixtures of tests/model and tests/weights, registered by tests/conftest.py)."""
import os

import pytest

from tests.tiny_models import DEEPSEEK, FAMILIES, HYBRID, make_tiny_checkpoint


def _made(tmp_path_factory, families) -> dict:
    """family -> (directory, transformers model in float32, eager attention)."""
    made = {}
    for family in families:
        directory = str(tmp_path_factory.mktemp(family))
        made[family] = (directory, make_tiny_checkpoint(directory, family))
    return made


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    return _made(tmp_path_factory, FAMILIES)


@pytest.fixture(scope="session")
def deepseek_checkpoints(tmp_path_factory):
    return _made(tmp_path_factory, DEEPSEEK)


@pytest.fixture(scope="session")
def hybrid_checkpoints(tmp_path_factory):
    return _made(tmp_path_factory, HYBRID)


@pytest.fixture(scope="session", autouse=True)
def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
