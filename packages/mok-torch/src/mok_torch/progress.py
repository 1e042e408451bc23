"""Progress of a long run: tqdm's bar on a terminal, plain lines in a log (a bar's redraws would
all land on one line of a file or a pipe)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class LineProgress:
    """The progress bar's calls for output that is not a terminal: a line every `every` steps
    (and at the last one)."""

    def __init__(self, total: int, desc: str, file: TextIO, every: int = 1) -> None:
        self.total, self.desc, self.file, self.every = total, desc, file, max(every, 1)
        self.done, self.what, self.start = 0, "", time.perf_counter()

    def set_postfix_str(self, what: str) -> None:
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


def progress_bar(total: int, desc: str, *, unit: str, file: TextIO | None = None, lines: int = 10) -> Any:
    """tqdm on a terminal; else a LineProgress of about `lines` lines."""
    out = sys.stderr if file is None else file
    if out.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=out)
    return LineProgress(total, desc, out, every=-(-total // max(lines, 1)))
