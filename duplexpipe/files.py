"""Files read and written safely, torch-free: what a user may give us read with its size checked before anything is
parsed and its names kept in their folder; what a run writes created without following a symbolic link."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from duplexpipe.sizes import format_bytes

_SEPARATORS = ("/", "\\", "\0")


def read_capped(path: str | os.PathLike[str], limit: int, what: str,
                error: type[ValueError] = ValueError) -> bytes:
    """The bytes of `path`, refused with `error` naming the file, its size and `limit` before more than `limit`
    bytes are read (a file whose size the file system does not know, as in /proc, is cut off at the limit too); a
    FIFO, a device or a socket is refused unopened (`require_regular`). OSError passes unchanged (its message names
    the file)."""
    require_regular(path, what, error)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise error(f"{what} {path} is {size:,} bytes, over the {format_bytes(limit)} limit for a {what}; "
                        "refused without reading it")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what} {path} holds more than {format_bytes(limit)}, the limit for a {what}; refused")
    return data


def read_capped_text(path: str | os.PathLike[str], limit: int, what: str,
                     error: type[ValueError] = ValueError) -> str:
    """`read_capped` as UTF-8 text; `error` naming the file when it is not UTF-8."""
    data = read_capped(path, limit, what, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not a text file (not UTF-8: {exc})") from None


def require_regular(path: str | os.PathLike[str], what: str, error: type[ValueError] = ValueError) -> None:
    """`error` naming `path` unless it is a regular file (after links): a FIFO would block the open until a writer
    comes, a device may never end; checked with os.stat, before anything opens it. OSError passes unchanged."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "not a file")
        raise error(f"{what} {path} is {kind}, not a regular file; refused without opening it")


def plain_name(name: object, where: str, error: type[ValueError] = ValueError) -> str:
    """`name` when it is a plain file name (no folder part, not "." or "..", not absolute): a name read from a file
    then stays inside the folder it is joined to; `error` naming `where` and the name otherwise."""
    if (not isinstance(name, str) or not name or name in (".", "..") or any(s in name for s in _SEPARATORS)
            or Path(name).is_absolute() or (len(name) > 1 and name[1] == ":")):
        raise error(f"{where} names {name!r}, which is not a plain file name inside the folder (no folders, no "
                    "'..', not absolute); refused")
    return name


NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
"""os.open's flag that refuses a symbolic link as the last part of the path (0 where the platform has none)."""


def _mode(mode: int) -> int:
    """`mode` less this process's umask (what os.open would have given a new file)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_atomic(path: str | os.PathLike[str], data: bytes | str, mode: int = 0o644) -> None:
    """Put `data` at `path` as a whole: written to a temporary file of an unpredictable name in the same folder
    (created exclusively, never through a link), flushed to disk, then renamed onto `path`. A symbolic link planted at
    `path` is replaced, never written through; readers see the old file or the new one."""
    target = Path(path)
    with naming(target):
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data.encode("utf-8") if isinstance(data, str) else data)
                fh.flush()
                os.fchmod(fh.fileno(), _mode(mode))
                os.fsync(fh.fileno())
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


@contextlib.contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """An OSError raised inside that names no file (a write or flush on a full disk: "No space left on device")
    raised again naming `path`, so the one-line error says where."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def create_exclusive(path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """A new file at `path` opened for writing (a descriptor): created exclusively without following a link; a
    file or link already at `path` is removed first (unlink removes a link, never its target)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, mode)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, flags, mode)


@contextlib.contextmanager
def open_new(path: str | os.PathLike[str], binary: bool = False) -> Iterator[IO[Any]]:
    """`create_exclusive` as a file object (text, UTF-8, unless `binary`)."""
    fd = create_exclusive(path)
    with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) as fh:
        yield fh


def open_append(path: str | os.PathLike[str]) -> IO[str]:
    """`path` opened to append text (created when missing), never through a symbolic link: OSError naming the file
    when `path` is one."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise refused_link(exc, path) from None
    return os.fdopen(fd, "a", encoding="utf-8")


def refused_link(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """`exc` from opening `path` with NOFOLLOW, said plainly when `path` is a symbolic link (ELOOP)."""
    if exc.errno == errno.ELOOP or (exc.errno == errno.EMLINK and os.path.islink(path)):
        return OSError(exc.errno, "it is a symbolic link, which a run never writes through", str(path))
    return exc
