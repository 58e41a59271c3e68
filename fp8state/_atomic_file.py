"""Write a file atomically: the destination is complete, or untouched.

The file is written next to the destination under a temporary name, flushed and synced to disk,
optionally checked, and only then renamed over the destination (or hard-linked, which never
replaces a file). Any failure, an interrupt included, removes the temporary file and leaves no
partial destination. The file gets the mode a plain ``open`` or ``torch.save`` would give it
(``0o666`` less the umask), not ``tempfile``'s 0600. Standard library only: the checkpoint
layer (consolidation) and the layers above it (migration, the demo's plot) share it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable
from typing import IO

__all__ = ["write_atomically", "NEW_FILE_MODE"]

#: Mode asked of the OS for a new file; the process's umask takes its bits away, as for ``open``.
NEW_FILE_MODE = 0o666
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
# A link is refused by some file systems (FAT, some network mounts): rename, after a check.
_NO_LINK = (errno.EPERM, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)


def _create_temp(directory: str, name: str) -> tuple[int, str]:
    """Create a new, empty ``.{name}.<random>.tmp`` in ``directory``; its fd and path."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, _FLAGS, NEW_FILE_MODE), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", directory)


def _publish(tmp: str, path: str, overwrite: bool) -> None:
    """Give the finished ``tmp`` the name ``path``; without ``overwrite``, never replace a file.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False (it may have appeared while
            the file was written).
    """
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if path exists, atomically
    except FileExistsError:
        raise
    except OSError as err:
        if err.errno not in _NO_LINK:
            raise
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _sync_directory(directory: str) -> None:
    # The rename is on disk only once the folder is: a crash could otherwise lose the new name.
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):  # some file systems refuse; the file itself is synced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomically(
    path: str | os.PathLike[str],
    write: Callable[[IO[bytes]], None],
    *,
    check: Callable[[str], None] | None = None,
    overwrite: bool = True,
) -> None:
    """Write a file at ``path`` with ``write(file)``, atomically.

    Args:
        path: The file to write.
        write: Writes the content into the binary file object it is given.
        check: Called with the temporary file's path once it is complete and synced; an
            exception it raises stops the write.
        overwrite: Replace an existing ``path``. When False an existing ``path`` is never
            replaced, also one that appears while the file is being written.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False; nothing is written.
        OSError: the folder is not writable, the disk is full, ``path`` is a folder; nothing
            is written.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = _create_temp(directory, os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        if check is not None:
            check(tmp)
        _publish(tmp, path, overwrite)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _sync_directory(directory)
