"""What differs between Linux, macOS and Windows, asked in one place
(``docs/architecture.md#portable-code``). Each function answers for this machine now.
``KMOSS_PORTABLE=1`` in the environment makes them answer as a machine without ``fcntl``,
``/dev/shm``, pidfds and the forkserver (Windows, in what it lacks): the test suite runs so
(``tests/conftest.py``; its ``native`` tests, and ``KMOSS_TEST_NATIVE=1``, run Linux's
paths), and every process it starts inherits it, so the paths a Windows user takes are the
tested ones.

- ``os_locks``: ``fcntl``'s advisory locks (Linux, macOS), else None: ``artifacts.dir_lock``
  then holds an exclusive lock file naming its holder, a dead holder's taken over.
- ``pid_alive``: whether a process runs, without ``os.kill(pid, 0)`` on Windows (where a
  signal 0 is CTRL_C_EVENT and a kill of the process group).
- ``worker_start``: ``forkserver`` where it and pidfds exist (the loader's workers then
  watch the trainer's pidfd), else ``spawn`` (the workers are the trainer's own children).
- ``shm_root``: ``/dev/shm`` where it is a writable tmpfs, else None: the node's shared
  weight copies then live in ``multiprocessing.shared_memory``.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import platform
import sys
from types import ModuleType

SHM_ROOT = "/dev/shm"
ENV = "KMOSS_PORTABLE"


def without_linux() -> bool:
    return os.environ.get(ENV) == "1"


def os_locks() -> ModuleType | None:
    if without_linux():
        return None
    try:
        return importlib.import_module("fcntl")
    except ImportError:
        return None


def pid_alive(pid: int) -> bool:
    if sys.platform == "win32":
        import ctypes

        kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
        handle = kernel32.OpenProcess(0x00100000, False, pid)  # SYNCHRONIZE
        if not handle:
            return False
        try:
            return kernel32.WaitForSingleObject(handle, 0) == 0x102  # WAIT_TIMEOUT: running
        finally:
            kernel32.CloseHandle(handle)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it runs
        return True
    return True


def pidfd_open(pid: int) -> int | None:
    """A pidfd of ``pid`` (Linux 5.3+), or None where there are none."""
    if without_linux() or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError as e:
        if isinstance(e, ProcessLookupError):
            raise
        return None


def worker_start() -> str:
    methods = multiprocessing.get_all_start_methods()
    native = not without_linux() and "forkserver" in methods and hasattr(os, "pidfd_open")
    return "forkserver" if native else "spawn"


def shm_root() -> str | None:
    root = SHM_ROOT
    if without_linux() or not root:
        return None
    return root if os.path.isdir(root) and os.access(root, os.W_OK) else None


def node_name() -> str:
    return platform.node() or "localhost"


def available_ram() -> int:
    """Bytes of host memory available now: ``MemAvailable`` (Linux), the free pages
    (``sysconf``: macOS), or ``GlobalMemoryStatusEx`` (Windows)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    if sys.platform == "win32":
        import ctypes

        class Status(ctypes.Structure):
            _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong),
                        ("total", ctypes.c_ulonglong), ("available", ctypes.c_ulonglong),
                        ("page_total", ctypes.c_ulonglong), ("page_free", ctypes.c_ulonglong),
                        ("virtual_total", ctypes.c_ulonglong), ("virtual_free", ctypes.c_ulonglong),
                        ("extended", ctypes.c_ulonglong)]

        status = Status(length=ctypes.sizeof(Status))
        ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status))  # type: ignore[attr-defined]
        return int(status.available)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
