"""The benchmarks' card log (``bench/_report.py``): nvidia-smi's samples summarised, and no
log (not an error) where nvidia-smi is missing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _report import CardLog, card_summary  # noqa: E402


def test_card_samples_become_min_median_max_and_bad_lines_are_skipped():
    text = "1980, 120.5, 39\n1635, 695.1, 57\n[N/A], 690.0, 58\n1665, 693.6, 56\n1590, 69"
    s = card_summary(text)
    assert s["samples"] == 3
    assert s["sm_mhz"] == [1635.0, 1665.0, 1980.0]
    assert s["power_w"] == [120.5, 693.6, 695.1]
    assert s["temp_c"] == [39.0, 56.0, 57.0]
    assert card_summary("") == {} and card_summary("[N/A], [N/A], [N/A]") == {}


def test_without_nvidia_smi_the_log_is_empty(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with CardLog() as log:
        pass
    assert log.proc is None and log.summary() == {}


def test_the_log_reads_what_nvidia_smi_printed_while_the_block_ran(tmp_path, monkeypatch):
    """A stand-in ``nvidia-smi`` that prints two samples, then waits to be stopped."""
    import time

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '1500, 690.0, 60'\necho '1700, 650.0, 58'\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    t0 = time.perf_counter()
    with CardLog(ms=100) as log:
        time.sleep(0.5)
    assert time.perf_counter() - t0 < 10  # stopped, not waited out
    assert log.summary() == {"sm_mhz": [1500.0, 1600.0, 1700.0], "power_w": [650.0, 670.0, 690.0],
                             "temp_c": [58.0, 59.0, 60.0], "samples": 2}


def test_rounds_cancel_a_drifting_clock():
    """Three identical calls under a clock that speeds up as the sweep goes on: timed one after
    another the last looks fastest, timed in rounds each gets the same median."""
    from _report import rounds_ms

    clock = {"t": 0}

    def window(fn, reps):  # each window 1% faster than the one before
        fn()
        clock["t"] += 1
        return 100.0 * 0.99 ** clock["t"]

    fns = {k: (lambda: None) for k in "abc"}
    one_after_another = {k: sorted(window(f, 1) for _ in range(5))[2] for k, f in fns.items()}
    assert one_after_another["c"] < one_after_another["a"] * 0.95
    clock["t"] = 0
    got = rounds_ms(fns, rounds=9, window=window)
    spread = max(got.values()) / min(got.values()) - 1
    assert spread < (one_after_another["a"] / one_after_another["c"] - 1) / 3  # two windows' drift, not ten
    calls = {"n": 0}
    rounds_ms({"x": lambda: calls.__setitem__("n", calls["n"] + 1)}, rounds=4, reps=2,
              window=lambda fn, reps: [fn() for _ in range(reps)] and 1.0)
    assert calls["n"] == 3 + 4 * 2  # warm-up, then each round's window
