"""Tiny random Hugging Face checkpoints of each supported family, saved once per test session."""
import os

import pytest

from tests.tiny_models import FAMILIES, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> (directory, transformers model in float32, eager attention)."""
    made = {}
    for family in FAMILIES:
        directory = str(tmp_path_factory.mktemp(family))
        made[family] = (directory, make_tiny_checkpoint(directory, family))
    return made


@pytest.fixture(scope="session", autouse=True)
def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
