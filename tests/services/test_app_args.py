"""The app's arguments (serve config `args`): validated before anything loads."""

import pydantic
import pytest

from services.config import AppArgs


def test_torch_threads_is_optional_and_positive():
    assert AppArgs(torch_threads=2).torch_threads == 2 and AppArgs().torch_threads is None
    with pytest.raises(pydantic.ValidationError):
        AppArgs(torch_threads=0)
