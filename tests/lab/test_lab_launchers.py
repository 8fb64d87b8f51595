"""How compare's launchers stop their workers when it leaves on a signal or an error."""

from __future__ import annotations

import time

import pytest

from archlab.lab import launchers
from tests.lab.lab_fakes import stubborn_worker


def test_workers_that_ignore_the_stop_share_one_wait_before_they_are_killed(tmp_path, monkeypatch):
    """Each worker used to get its own wait, so a pool of twelve stuck workers held compare for
    twelve times the grace period: past the end of a lent machine's call."""
    monkeypatch.setattr(launchers, "_STOP_WAIT_S", 3.0)
    ready = [tmp_path / f"ready{i}" for i in range(3)]
    with pytest.raises(KeyboardInterrupt):
        with launchers.PoolLauncher(3, tmp_path / "db", None, stubborn_worker) as pool:
            futures = [pool.start(str(path)) for path in ready]
            deadline = time.monotonic() + 60
            while not all(path.exists() for path in ready) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(path.exists() for path in ready)
            t0 = time.monotonic()
            raise KeyboardInterrupt
    waited = time.monotonic() - t0
    assert 2.5 < waited < 6.0  # one grace period, not three
    assert all(f.done() for f in futures)
