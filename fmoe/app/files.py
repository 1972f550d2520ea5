"""Atomic file writes: every file fmoe writes is whole (new or old), never half-written.

`write_atomic(path, write)` hands `write` a binary file under a temporary name in the same
folder, fsyncs it, renames it over `path` and fsyncs the folder. If anything fails (a full disk,
a kill, a bug in `write`) the temporary file is removed and `path` keeps its previous content.
A SIGKILL leaves its temporary file behind; the next write into that folder by a later process
removes such leftovers (fmoe's own `.name.XXXXXXXX.tmp` names only, last changed before this
process started, so another process's write in progress is left alone).
"""
import errno
import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Callable, Union

PathLike = Union[str, Path]
UMASK = os.umask(0)
os.umask(UMASK)
STARTED = time.time()
TEMP_NAME = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")      # what mkstemp(prefix=".name.", suffix=".tmp") makes
_swept = set()


class WriteError(OSError):
    """A write that failed, with the path and the reason (`disk full` for ENOSPC) in its message."""


def fsync_dir(folder: PathLike):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Write `path` through `write(f)` on a temporary file, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~UMASK)       # the mode a plain open() would give, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(err, OSError) and not isinstance(err, WriteError):
            raise write_error(path, err) from err
        if isinstance(err, RuntimeError) and "unexpected pos" in str(err):     # torch.save's zip writer on ENOSPC
            raise WriteError(errno.EIO, f"could not write {path}: the write stopped short ({err}); "
                             f"is the disk full? {path} is unchanged") from err
        raise
    fsync_dir(path.parent)
    return path


def remove_stale_temporaries(folder: Path):
    """Once per folder and process: remove temporary files that a killed earlier write left there."""
    if folder in _swept:
        return
    _swept.add(folder)
    for entry in os.scandir(folder):
        try:
            if TEMP_NAME.fullmatch(entry.name) and entry.is_file() and entry.stat().st_mtime < STARTED:
                os.unlink(entry.path)
        except FileNotFoundError:        # another process removed it first
            pass


def fault(code: int) -> str:
    """What an errno means to someone whose write failed."""
    return "disk full (ENOSPC)" if code == errno.ENOSPC else os.strerror(code)


def write_error(path: Path, err: OSError) -> WriteError:
    reason = fault(err.errno) if err.errno else str(err)
    return WriteError(err.errno, f"could not write {path}: {reason}; {path} is unchanged")


def check_writable_folder(path: PathLike, what: str) -> Path:
    """That the folder `path` exists or can be made, and takes new files: found out before a run starts,
    not at its first save. Nothing is left behind (an unnamed temporary file in `path`, or in the folder
    that would hold it, is the probe). A ValueError naming `what` if not."""
    path = Path(path)
    nearest = next(p for p in (path, *path.parents) if p.exists())
    if not nearest.is_dir():
        where = "is a file" if nearest == path else f"is under the file {nearest}"
        raise ValueError(f"{what} {str(path)!r} {where}; it must be a folder (existing or new)")
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as err:
        raise ValueError(f"{what} {str(path)!r} must be a folder fmoe can create and write in: "
                         f"{err.strerror or err}") from None
    return path


def write_bytes(path: PathLike, data: bytes) -> Path:
    return write_atomic(path, lambda f: f.write(data))


def write_text(path: PathLike, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: PathLike, obj, indent=None) -> Path:
    return write_text(path, json.dumps(obj, indent=indent) + ("\n" if indent else ""))


def save_torch(path: PathLike, obj) -> Path:
    import torch

    return write_atomic(path, lambda f: torch.save(obj, f))


def save_figure(path: PathLike, fig, **kwargs) -> Path:
    """A matplotlib figure, its format from the path's suffix."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    return write_atomic(path, lambda f: fig.savefig(f, format=fmt, **kwargs))


def sha256_file(path: PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
