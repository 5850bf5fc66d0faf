"""Every 2-rank test is bounded: a hung collective ends the run with a traceback, never a hang."""

from __future__ import annotations

import faulthandler
from typing import Iterator

import pytest

TEST_TIMEOUT = 150.0


@pytest.fixture(autouse=True)
def bounded() -> Iterator[None]:
    faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
