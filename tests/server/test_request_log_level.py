"""server.request_log alone turns the request lines on or off, whatever log_level is."""

from __future__ import annotations

import io
import json
import logging

import pytest

from server.http import request_log


@pytest.fixture
def quiet_root():
    """The root at WARNING (``--log-level warning``); the request logger restored after."""
    root, logger = logging.getLogger(), request_log.log
    saved = (root.level, logger.level, logger.propagate, list(logger.handlers))
    root.setLevel(logging.WARNING)
    yield
    root.setLevel(saved[0])
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    for handler in saved[3]:
        logger.addHandler(handler)


def test_request_lines_survive_a_warning_log_level(quiet_root):
    out = io.StringIO()
    request_log.configure(True, stream=out)
    request_log._emit({"request_id": "cmpl-1", "status": 200})
    line = json.loads(out.getvalue())
    assert line["event"] == "request_end" and line["request_id"] == "cmpl-1"


def test_request_log_false_writes_nothing(quiet_root):
    out = io.StringIO()
    request_log.configure(False, stream=out)
    request_log._emit({"request_id": "cmpl-2", "status": 200})
    assert out.getvalue() == ""
