"""The shared I/O contracts every stage relies on: one error path, file modes, locks, temp
sweeping, byte-stable safetensors files, and the kill points the fault tests use."""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import subprocess
import sys
import time

import pytest
import torch
import typer
from safetensors import SafetensorError
from safetensors.torch import load_file

from kohakumoss.artifacts import (LockBusy, atomic_write_text, dir_lock, hash_file, sweep_temps,
                                  temp_dir, write_safetensors)
from kohakumoss.configlib import ConfigError
from kohakumoss.errors import KohakuError, user_message
from stages.common import stage


def test_user_message_names_what_the_user_fixes():
    assert user_message(ConfigError("optim.lr = 'x' is not allowed: a number")) == \
        "optim.lr = 'x' is not allowed: a number"
    full = user_message(OSError(errno.ENOSPC, "No space left on device", "/data/shard.tmp"))
    assert "out of disk space" in full and "/data/shard.tmp" in full and "again" in full
    too_big = user_message(OSError(errno.EFBIG, "File too large"))
    assert "file-size limit" in too_big
    # libraries that re-word the OS error: a Rust crate, SQLite, a wrapped cause
    rust = SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    assert "file-size limit" in user_message(rust)
    assert "out of disk space" in user_message(sqlite3.OperationalError("database or disk is full"))
    try:
        try:
            raise OSError(errno.EACCES, "Permission denied", "/models/x.safetensors")
        except OSError as e:
            raise RuntimeError("could not save") from e
    except RuntimeError as wrapped:
        assert "/models/x.safetensors" in user_message(wrapped)
    # bugs keep their traceback
    assert user_message(ValueError("x (os error 2)")) is None
    assert user_message(KeyError("k")) is None
    assert user_message(OSError(errno.ENOENT, "No such file")) is None


def test_stage_wrapper_prints_one_line_and_exits_2(capsys):
    @stage
    def disk_full():
        raise SafetensorError("I/O error: No space left on device (os error 28)")

    @stage
    def user_error():
        raise KohakuError("params.yaml: model.vae = '/x' does not exist; fix the path")

    @stage
    def bug():
        raise ZeroDivisionError("a bug")

    for fn, words in ((disk_full, "out of disk space"), (user_error, "model.vae")):
        with pytest.raises(typer.Exit) as e:
            fn()
        assert e.value.exit_code == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and err.count("error:") == 1
    with pytest.raises(ZeroDivisionError):
        bug()


def test_files_0644_and_folders_0755_under_the_usual_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        folder = temp_dir(tmp_path)
        write_safetensors({"t": torch.zeros(2)}, tmp_path / "t.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    os.umask(0o077)  # a stricter umask is respected
    try:
        atomic_write_text(tmp_path / "b.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "b.txt").stat().st_mode) == 0o600


def test_sweep_removes_only_temp_files(tmp_path):
    (tmp_path / "sub").mkdir()
    leftovers = [tmp_path / ".shard-00001.safetensors.ab12.tmp", tmp_path / "sub" / ".x.json.q.tmp"]
    for p in leftovers:
        p.write_text("half")
    (tmp_path / ".tmp-abc").mkdir()
    keep = [tmp_path / "shard-00000.safetensors", tmp_path / "notes.tmp.txt", tmp_path / ".keep"]
    for p in keep:
        p.write_text("ok")
    assert sorted(sweep_temps(tmp_path)) == sorted(leftovers + [tmp_path / ".tmp-abc"])
    assert all(p.exists() for p in keep) and not any(p.exists() for p in leftovers)


HOLD = """
import sys, time
from kohakumoss.artifacts import dir_lock
with dir_lock(sys.argv[1], "holder"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


MODES = [pytest.param("native", marks=pytest.mark.native), "portable"]  # flock / a lock file (kohakumoss/portable.py)


@pytest.mark.parametrize("mode", MODES)
def test_dir_lock_names_the_holder_and_frees_on_exit_or_kill(tmp_path, mode):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "30"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(LockBusy, match=f"pid {holder.pid}"):
        with dir_lock(tmp_path, "second", wait=False):
            pass
    holder.kill()  # kill -9: the kernel releases the lock
    holder.wait()
    t0 = time.monotonic()
    with dir_lock(tmp_path, "second", wait=True, poll=0.05):
        assert (tmp_path / ".kmoss.lock").read_text().split()[0] == str(os.getpid())
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("mode", MODES)
def test_a_waiting_writer_gets_the_lock_when_the_first_ends(tmp_path, mode):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "1.5"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    with dir_lock(tmp_path, "second", wait=True, poll=0.05):
        waited = time.monotonic() - t0
    holder.wait()
    assert 0.5 < waited < 20


WRITE = """
import sys, torch
from kohakumoss.artifacts import write_safetensors
t = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
write_safetensors(t, sys.argv[1], {"kohakumoss_run": "default", "kohakumoss_base": "tiny",
                                   "ss_network_dim": "8", "note": "ünïcode"})
"""


def test_safetensors_files_are_byte_stable_across_processes(tmp_path):
    # safetensors writes its metadata map in a per-process random order
    digests = set()
    for i in range(5):
        path = tmp_path / f"f{i}.safetensors"
        subprocess.run([sys.executable, "-c", WRITE, str(path)], check=True)
        digests.add(hash_file(path))
    assert len(digests) == 1
    back = load_file(str(tmp_path / "f0.safetensors"))
    assert torch.equal(back["w"], torch.arange(12.0).reshape(3, 4))


KILL = """
from kohakumoss import faults
for i in range(5):
    print(i, flush=True)
    faults.point("demo")
"""


@pytest.mark.parametrize("target,printed", [("demo", "0"), ("demo:3", "0 1 2"), ("other", "0 1 2 3 4")])
def test_kill_points_fire_only_where_named(target, printed):
    env = {**os.environ, "KMOSS_KILL_AT": target}
    res = subprocess.run([sys.executable, "-c", KILL], env=env, capture_output=True, text=True)
    assert res.stdout.split() == printed.split()
    assert res.returncode == (0 if target == "other" else -9)


LOADER = """
import os, sys, time
from kohakumoss.data.loader import make_loader


class Batches:
    def __len__(self):
        return 10**6

    def batch(self, index):
        time.sleep(0.01)
        return os.getpid()


if __name__ == "__main__":
    pids, batches = set(), iter(make_loader(Batches(), num_workers=2, prefetch=2))
    while len(pids) < 2:
        pids.add(next(batches))
    print(*sorted(pids), flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead but not yet reaped by its parent
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")
@pytest.mark.parametrize("mode", MODES)  # forkserver workers watching a pidfd / spawned ones
def test_a_killed_trainer_leaves_no_loader_worker_behind(tmp_path, mode):
    script = tmp_path / "trainer.py"
    script.write_text(LOADER)
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = [int(p) for p in trainer.stdout.readline().split()]
    assert len(workers) == 2 and all(_alive(p) for p in workers)
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers)
