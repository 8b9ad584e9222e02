"""Write a save file atomically: through a temporary in the target's folder, renamed into place.

The temporary is `.<name>.dendrite-tmp-<host>-<pid>-<random>`, so that what a killed save left behind can be told
apart from anything else in the folder, and tied to its target and its writer. Each save first deletes the stale
temporaries of its own target: those written on this host by a process that no longer runs (or by this process,
by a save that has ended), and any older than STALE_AFTER_S (a writer on another host sharing the folder, or a
process id that was reused since). A save running elsewhere keeps its temporary; no other file is touched.

Every failure of the file system is a SaveFileError that names the path and says what to do; any file already at
the target is unchanged.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

from .errors import SaveFileError

MARK = ".dendrite-tmp-"
# A save writes its temporary continuously and renames it within seconds to minutes; one untouched for an hour
# belongs to a save that died, wherever it ran.
STALE_AFTER_S = 3600
# The host in a temporary's name: characters any file system takes, short enough to leave room for the target's.
HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:32] or "host"
# Temporaries of saves running in this process: any other of this process's is stale.
_writing: set[str] = set()

# Why a write failed, and what to do, by errno.
_REASONS = {
    errno.ENAMETOOLONG: ("a name in the path is too long for the file system", "save under a shorter name"),
    errno.ELOOP: ("the path runs into a loop of symbolic links", "fix the link or save somewhere else"),
    errno.ENOTDIR: ("a part of its folder path is a file, not a folder", "save somewhere else"),
    errno.EEXIST: ("a part of its folder path is a file, not a folder", "save somewhere else"),
    errno.EISDIR: ("it is a folder", "save to a file in it"),
    errno.EACCES: ("permission denied", "save in a folder you can write to"),
    errno.EPERM: ("permission denied", "save in a folder you can write to"),
    errno.EROFS: ("the file system is read-only", "save somewhere else"),
    errno.ENOSPC: ("the disk is full", "free some space or save somewhere else"),
    getattr(errno, "EDQUOT", errno.ENOSPC): ("the disk quota is used up", "free some space or save somewhere else"),
}


def write_error(target: Path, error: OSError) -> SaveFileError:
    why, fix = _REASONS.get(error.errno, (error.strerror or str(error), "save somewhere else"))
    where = f" ({error.filename})" if error.filename and str(error.filename) != str(target) else ""
    return SaveFileError(f"cannot save to {str(target)!r}: {why}{where}; {fix}. Any file already there is unchanged.")


def check_target(target: Path) -> None:
    """Raise SaveFileError unless `target` is absent or a regular file (before any work is done for the save):
    replacing a device or a pipe would destroy it."""
    try:
        info = target.stat()
    except FileNotFoundError:
        return
    except OSError as error:
        raise write_error(target, error) from None
    if stat.S_ISDIR(info.st_mode):
        raise SaveFileError(f"{str(target)!r} is a folder; save to a file in it, such as "
                            f"{str(target / 'session.dendrite')!r}.")
    if not stat.S_ISREG(info.st_mode):
        raise SaveFileError(f"{str(target)!r} is not a regular file (a device, a pipe or a socket), which a save "
                            f"would replace; save to a file.")


def temporary_prefix(target: Path) -> str:
    """`.<name>.dendrite-tmp-`: the start of the names of `target`'s temporaries, and of no other target's. A
    name too long to leave room for the rest keeps its first 60 bytes and a hash of the whole."""
    raw = os.fsencode(target.name)
    if len(raw) > 150:   # a file name has at most 255 bytes on the usual file systems
        raw = raw[:60] + b"~" + hashlib.sha256(raw).hexdigest()[:16].encode()
    return "." + os.fsdecode(raw) + MARK


def write_atomically(target: Path, write: Callable[[str], None], mode: int) -> None:
    """Call `write(temporary)`, fsync the temporary, give it `mode` and rename it to `target`; on any failure
    delete the temporary. Missing folders are made."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        handle, temporary = tempfile.mkstemp(prefix=f"{temporary_prefix(target)}{HOST}-{os.getpid()}-",
                                             dir=target.parent)
    except OSError as error:
        raise write_error(target, error) from None
    temporary = os.path.abspath(temporary)
    _writing.add(temporary)
    try:
        os.close(handle)
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, target)  # atomic: readers see the old file or the new one, never a mix
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise write_error(target, error) from None
        raise
    finally:
        _writing.discard(temporary)


def remove_stale_temporaries(target: Path) -> list[str]:
    """Delete the temporaries of earlier saves to `target` whose writer is gone (see the module docstring);
    returns their names. Only regular files named for this target are candidates."""
    pattern = re.compile(re.escape(temporary_prefix(target))
                         + r"(?P<host>[A-Za-z0-9._-]*)-(?P<pid>\d{1,12})-[a-z0-9_]+\Z")   # mkstemp's random part
    folder, now, removed = target.parent, time.time(), []
    try:
        names = os.listdir(folder)
    except OSError:   # the save itself reports a folder it cannot use
        return removed
    for name in names:
        match = pattern.match(name)
        path = os.path.abspath(os.path.join(folder, name))
        if match is None or path in _writing:
            continue
        try:
            info = os.lstat(path)
            gone = match["host"] == HOST and not _running(int(match["pid"]), path)
            if stat.S_ISREG(info.st_mode) and (gone or now - info.st_mtime > STALE_AFTER_S):
                os.unlink(path)
                removed.append(name)
        except OSError:   # removed meanwhile by another save, or not ours to remove: leave it
            continue
    return removed


def _running(pid: int, path: str) -> bool:
    """Whether the process that wrote the temporary at `path` may still be writing it."""
    if pid == os.getpid():
        return path in _writing
    if os.name != "posix":   # os.kill(pid, 0) is not a probe there; age alone decides
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        return True
    except (OverflowError, ValueError):   # no process has such an id
        return False
    return True
