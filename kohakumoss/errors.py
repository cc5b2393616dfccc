"""The project's base error: every failure a user can fix is a ``KohakuError``.

Each subsystem keeps its own subclass (``ConfigError``, ``ArtifactError``, ``CacheMiss``,
``ExportError`` ...), so code can catch what it expects; the command line catches the base
class once (``stages.common.stage``) and prints one line naming the file or key and the
fix, with exit status 2. ``user_message`` also turns the operating-system failures a user
fixes by hand (a full disk, a file-size limit, a missing permission) into such a line;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import re

# errors the user fixes on the machine, not in the code: a full disk or quota, a file-size
# limit (RLIMIT_FSIZE), a read-only disk, a permission
DISK_FULL = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
MACHINE = DISK_FULL | {errno.EROFS, errno.EACCES, errno.EPERM}


class KohakuError(Exception):
    """A failure the user can fix; the message names the file or key and the fix."""


class IntegrityError(KohakuError):
    """Bytes on disk that do not match the hash their manifest records."""


# how libraries that do their own I/O report an OS error in their message: Rust crates
# (safetensors, tokenizers) say "(os error 27)"; SQLite (DVC's state) names no errno at all
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
SQLITE_FULL = ("database or disk is full", "disk I/O error")


def _as_os_error(e: BaseException) -> OSError | None:
    if isinstance(e, OSError):
        return e if e.errno in MACHINE else None
    m = RUST_OS_ERROR.search(str(e))
    if m and int(m.group(1)) in MACHINE:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    if type(e).__module__ == "sqlite3" and str(e) in SQLITE_FULL:
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (SQLite: {e})")
    return None


def find_machine_error(exc: BaseException) -> OSError | None:
    """The OS error in ``exc``'s cause chain that a user fixes on the machine, if any
    (libraries often re-raise a full disk as their own error type)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        found = _as_os_error(e)
        if found is not None:
            return found
        e = e.__cause__ or e.__context__
    return None


def user_message(exc: BaseException) -> str | None:
    """One line for a failure the user can fix, or None for a bug (keep the traceback)."""
    if isinstance(exc, KohakuError):
        return str(exc)
    os_err = find_machine_error(exc)
    if os_err is None:
        return None
    where = f" writing {os_err.filename}" if os_err.filename else ""
    if os_err.errno in DISK_FULL:
        return (f"out of disk space or over the file-size limit{where} ({os_err.strerror}); "
                f"nothing half-written was kept. Free space (or raise the limit) and run the "
                f"same command again: it resumes")
    return (f"{os_err.strerror}{where}: check the permissions of that path (and that the disk is "
            f"writable), then run the same command again")
