"""Admission (service/admission.py): calls in flight, and their refusal once shutdown has begun."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from kvpool_server.service.admission import Admission
from kvpool_server.service.errors import ServerShuttingDownError


def test_admission_counts_admitted_calls_and_refuses_once_started() -> None:
    admission = Admission()
    admission.admit()
    admission.admit()
    assert admission.num_in_flight == 2 and not admission.draining
    admission.release()
    admission.start()
    assert admission.draining
    with pytest.raises(ServerShuttingDownError, match="shutting down"):
        admission.admit()
    assert admission.num_in_flight == 2  # the refused call is counted until its caller releases it
    admission.release()
    admission.release()
    assert admission.num_in_flight == 0


def test_admission_waits_for_quiet_then_for_the_calls_in_flight() -> None:
    admission = Admission()
    admission.admit()
    admission.start()
    started = time.monotonic()
    admission.wait_quiet(quiet_s=0.05, max_s=5.0)  # nobody is refused: quiet 0.05 s after start()
    assert time.monotonic() - started < 1.0 and admission.quiet_since <= started
    assert admission.wait_idle(0.05) == 1  # the call admitted before start() is still running
    threading.Timer(0.1, admission.release).start()
    assert admission.wait_idle(5.0) == 0


def test_admission_wait_quiet_stops_at_max_s_while_calls_keep_being_refused() -> None:
    admission = Admission()
    admission.start()
    stop = threading.Event()

    def refused_calls() -> None:
        while not stop.is_set():
            with contextlib.suppress(ServerShuttingDownError):
                admission.admit()
            admission.release()
            time.sleep(0.01)

    caller = threading.Thread(target=refused_calls)
    caller.start()
    try:
        started = time.monotonic()
        admission.wait_quiet(quiet_s=0.2, max_s=0.3)
        assert 0.3 <= time.monotonic() - started < 1.0
    finally:
        stop.set()
        caller.join()
