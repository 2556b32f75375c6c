"""The ranks' standard error of a local job, gathered in one file: relayed to the launcher's as it comes, except
torch's native (C++) log records and stack frames, which are held back there (a dying peer's pages of TCPStore frames
would bury the cause); the file is kept and named when it holds something the user did not see."""

from __future__ import annotations

import os
import re
import tempfile
from typing import Protocol

from duplexpipe.files import NOFOLLOW

NATIVE_LINE = re.compile(r"^(?:\[rank\d+\]:)?\[?[WEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w./\\-]+\.(?:cpp|hpp|cc|h):\d+\]"
                         r"|^Exception raised from |^frame #\d+: ")
"""A line of torch's native log: a C++ warning or error record, or the stack frames that follow one."""
_CHUNK = 1 << 16


class TextSink(Protocol):
    """Where relayed lines go (sys.stderr)."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


def send_stderr_to(path: str) -> None:
    """In a rank: its standard error (file descriptor 2: Python's and torch's native log alike) appends to `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | NOFOLLOW)
    try:
        os.dup2(fd, 2)
    finally:
        os.close(fd)


class RankOutput:
    """The file the ranks' standard error goes to (created with an unpredictable name in the temporary folder), read
    back by the launcher (`relay`)."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="duplexpipe-ranks-", suffix=".log")
        os.close(fd)
        self._offset = 0
        self._partial = b""
        self.held = 0
        """Lines of torch's native log held back so far."""

    def relay(self, stream: TextSink, final: bool = False) -> None:
        """Write the lines the ranks added since the last call to `stream`, holding back torch's native log lines
        (`final`: a last line without its newline too)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read(_CHUNK * 16)
        except OSError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # a line not yet ended (b"" when the data ended with a newline)
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        shown = []
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")
            if NATIVE_LINE.search(line):
                self.held += 1
            else:
                shown.append(line + "\n")
        if shown:
            stream.write("".join(shown))
            stream.flush()

    def unseen(self) -> int:
        """Lines of the file the launcher did not show (held back, or written after it stopped relaying)."""
        sink = _Counter()
        while True:
            offset = self._offset
            self.relay(sink, final=True)
            if self._offset == offset:
                return self.held + sink.lines

    def close(self, keep: bool) -> str | None:
        """Remove the file unless `keep` (or it holds held-back lines); the path when it is kept."""
        if keep or self.held:
            return self.path
        try:
            os.unlink(self.path)
        except OSError:
            pass
        return None


class _Counter:
    """A text stream that counts the lines written to it."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        return len(text)

    def flush(self) -> None:
        pass
