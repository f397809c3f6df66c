"""Report files: checked before a run starts, written atomically when it ends.

:func:`check_writable` says before a long run whether a report could be written where it is
asked for; :func:`write_atomic` writes it to a temporary file in the destination's folder and
renames that over the destination, so a reader (or a full disk) never leaves half a report.
Both raise :class:`WriteError`, whose message names the path and why.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

_serial = itertools.count()


class WriteError(OSError):
    """A report that cannot be written; ``str(exc)`` is ``"<path>: <why>"``, ``path`` the path."""

    def __init__(self, path: str | os.PathLike, why: str):
        super().__init__(f"{os.fspath(path)}: {why}")
        self.path = Path(path)


def _destination(path: str | os.PathLike) -> Path:
    """``path``, or the file a symlink at ``path`` points to (the link is kept, its target replaced)."""
    path = Path(path)
    return path.resolve() if path.is_symlink() else path


def check_writable(path: str | os.PathLike) -> Path:
    """The file a report for ``path`` would be written to, once checked that it can be.

    Checked: ``path`` is not a folder, and its nearest existing parent is a folder this process
    may create files in (missing folders below it are created by :func:`write_atomic`). Nothing
    is created. Raises :class:`WriteError` naming ``path`` otherwise.
    """
    target = _destination(path)
    if target.is_dir():
        raise WriteError(path, "is a folder, not a file")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise WriteError(path, f"{parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise WriteError(path, f"no permission to create files in {parent}")
    return target


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (str as UTF-8) to ``path`` atomically, creating missing folders; returns the path.

    The bytes go to a hidden temporary file beside the destination, are flushed to the disk, and
    the file is renamed over the destination: afterwards ``path`` holds either its old content or
    all of ``data``. On failure the temporary file is removed and :class:`WriteError` names ``path``.
    """
    target = check_writable(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    part = target.with_name(f".{target.name}.{os.getpid()}.{next(_serial)}.part")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, target)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise WriteError(path, f"cannot write it ({exc.strerror or exc})") from exc
    return Path(path)
