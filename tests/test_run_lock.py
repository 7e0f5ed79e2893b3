"""One trainer per run folder: a second one stops at once with the holder named, and a killed holder's lock is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from drafters.training.lock import LOCK, RunBusy, holder, run_lock

HOLD = "import sys, time; from drafters.training.lock import run_lock\nwith run_lock(sys.argv[1]):\n" \
       "    print('held', flush=True); time.sleep(60)"


def test_a_second_trainer_is_refused_while_the_first_holds_the_run(tmp_path):
    with run_lock(tmp_path / "run"):
        assert (tmp_path / "run" / LOCK).read_text() == str(os.getpid())
        with pytest.raises(RunBusy, match=f"process {os.getpid()}"):
            with run_lock(tmp_path / "run"):
                pass
        with run_lock(tmp_path / "other"):  # another run is free
            pass
    with run_lock(tmp_path / "run"):  # let go at the end of the body
        pass


def test_the_lock_is_let_go_when_the_body_raises(tmp_path):
    with pytest.raises(KeyError):
        with run_lock(tmp_path):
            raise KeyError("killed mid-run")
    with run_lock(tmp_path):
        pass


def test_a_holder_killed_without_warning_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunBusy, match=f"process {holder.pid}"):
            with run_lock(tmp_path):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # the kernel drops a dead process's locks as it reaps its files
        try:
            with run_lock(tmp_path):
                break
        except RunBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_the_holder_is_named_while_it_trains_and_none_after(tmp_path):
    assert holder(tmp_path) is None  # never trained
    with run_lock(tmp_path):
        assert holder(tmp_path) == os.getpid()
    assert holder(tmp_path) is None
    with run_lock(tmp_path):  # asking took nothing from the trainer
        pass
