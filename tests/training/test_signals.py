"""SignalFlag: the first SIGINT / SIGTERM asks the loop to checkpoint and exit; a second one interrupts."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from relayrl.training.signals import SignalFlag


def test_no_signal_exits_zero():
    stop = SignalFlag()
    with stop.installed():
        pass
    assert stop.signum is None and stop.exit_code() == 0


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_sets_the_flag_and_the_exit_code(sig, code, capsys):
    stop = SignalFlag("relayrl sft")
    with stop.installed():
        os.kill(os.getpid(), sig)  # delivered to the main thread before kill returns to Python code
        assert stop.signum == sig
    assert stop.exit_code() == code
    err = capsys.readouterr().err
    assert f"relayrl sft: signal {int(sig)}: finishing this step, then writing a checkpoint" in err


def test_second_signal_interrupts_at_once():
    stop = SignalFlag()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert stop.signum == signal.SIGTERM  # the first signal decides the exit code
    assert stop.exit_code() == 143


def test_previous_handlers_come_back_after_the_block():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = SignalFlag()
    with stop.installed():
        assert signal.getsignal(signal.SIGINT) == stop._handle
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert {s: signal.getsignal(s) for s in before} == before


def test_outside_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def body():
        with SignalFlag().installed():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [before]
