"""Fixtures shared by the weight tests."""
import pytest

from tests.weights.mxfp4_writer import write_tiny_gpt_oss_checkpoint


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    """(directory, transformers model) of a tiny gpt-oss checkpoint with MXFP4 experts."""
    directory = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    return directory, write_tiny_gpt_oss_checkpoint(directory, seed=0)
