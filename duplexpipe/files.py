"""Files a user may receive, read torch-free: the size checked before anything is parsed, names kept in their folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from duplexpipe.sizes import format_bytes

_SEPARATORS = ("/", "\\", "\0")


def read_capped(path: str | os.PathLike[str], limit: int, what: str,
                error: type[ValueError] = ValueError) -> bytes:
    """The bytes of `path`, refused with `error` naming the file, its size and `limit` before more than `limit`
    bytes are read (a device or a pipe whose size the file system does not know is cut off at the limit too).
    OSError passes unchanged (its message names the file)."""
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
