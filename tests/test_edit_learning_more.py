"""The other half of tests/test_edit_learning.py's runs (every algorithm learns the tiny edit task), in a file of its
own so that pytest-xdist, which hands a file to a worker, runs the two halves on both cores."""

import pytest

from tests.test_edit_learning import GAIN, HERE, edit_prompts, edit_run_gains  # noqa: F401  (edit_prompts: the fixture)


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(set(GAIN) - set(HERE)))
def test_a_short_edit_run_raises_the_edit_reward(algo, edit_prompts, tmp_path):  # noqa: F811
    edit_run_gains(algo, edit_prompts, tmp_path)
