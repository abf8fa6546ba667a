"""Progress of a batch job: rows done / failed, rate and ETA, as log lines (what ``ray job logs`` shows)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    def __init__(self, total: int, skipped: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.skipped = skipped
        self.ok = 0
        self.failed = 0
        self.clock = clock
        self.start = clock()
        self.errors: dict[str, int] = {}

    def add(self, status: str, error_code: str | None = None) -> None:
        if status == "ok":
            self.ok += 1
        else:
            self.failed += 1
            key = error_code or "error"
            self.errors[key] = self.errors.get(key, 0) + 1

    @property
    def done(self) -> int:
        return self.ok + self.failed

    @property
    def todo(self) -> int:
        return self.total - self.skipped

    def rate(self) -> float:
        elapsed = self.clock() - self.start
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        rate = self.rate()
        left = self.todo - self.done
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        pct = 100.0 * self.done / self.todo if self.todo else 100.0
        return (
            f"[prism-batch] {self.done}/{self.todo} rows ({pct:.0f}%) ok={self.ok} failed={self.failed} "
            f"skipped={self.skipped} rate={rate:.2f} rows/s eta={eta}"
        )

    def summary(self) -> dict[str, object]:
        return {
            "rows": self.total,
            "skipped_already_ok": self.skipped,
            "processed": self.done,
            "ok": self.ok,
            "failed": self.failed,
            "errors_by_code": dict(sorted(self.errors.items())),
            "seconds": round(self.clock() - self.start, 3),
            "rows_per_s": round(self.rate(), 3),
        }
