"""Progress of a long run: tqdm's bar on a terminal, plain lines in a log (a bar's redraws would
all land on one line of a file or a pipe)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class LineProgress:
    """The progress bar's calls for output that is not a terminal: a line every `every` steps
    (and at the last one); with `announce`, also a line whenever the postfix string names a new
    part of the work, so that a log shows what a long step is doing (a provider's first call that
    compiles for minutes, say) before the step ends."""

    def __init__(self, total: int, desc: str, file: TextIO, every: int = 1, announce: bool = False) -> None:
        self.total, self.desc, self.file, self.every = total, desc, file, max(every, 1)
        self.announce = announce
        self.done, self.what, self.start = 0, "", time.perf_counter()

    def set_postfix_str(self, what: str) -> None:
        if self.announce and what != self.what:
            elapsed = time.perf_counter() - self.start
            line = f"{self.desc}: {self.done}/{self.total} after {elapsed:.0f} s, now {what}"
            print(line, file=self.file, flush=True)
        self.what = what

    def set_postfix(self, **values: Any) -> None:
        self.what = ", ".join(f"{k}={v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done % self.every and self.done != self.total:
            return
        elapsed = time.perf_counter() - self.start
        what = f" ({self.what})" if self.what else ""
        print(f"{self.desc}: {self.done}/{self.total} after {elapsed:.0f} s{what}", file=self.file, flush=True)

    def close(self) -> None:
        pass


def progress_bar(
    total: int, desc: str, *, unit: str, file: TextIO | None = None, lines: int = 10, announce: bool = False
) -> Any:
    """tqdm on a terminal; else a LineProgress of about `lines` lines (and, with `announce`, one
    more each time the postfix string changes)."""
    out = sys.stderr if file is None else file
    if out.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=out)
    return LineProgress(total, desc, out, every=-(-total // max(lines, 1)), announce=announce)
