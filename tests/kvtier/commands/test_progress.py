"""The progress line: drawn in place in a terminal, throttled, erased at the end; silent elsewhere."""

from __future__ import annotations

import io

from kvtier.commands.progress import MIN_INTERVAL_S, Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_draws_in_place_throttles_and_erases() -> None:
    now = [100.0]
    out = Tty()
    with Progress("work", out, clock=lambda: now[0]) as bar:
        bar.update("step 1")
        now[0] += MIN_INTERVAL_S / 2
        bar.update("step 2")  # too soon: skipped
        now[0] += MIN_INTERVAL_S
        bar.update("step 3")
        bar.update("last", force=True)
    text = out.getvalue()
    assert "step 1" in text and "step 2" not in text and "step 3" in text and "last" in text
    assert text.startswith("\rwork: step 1 (0 s)")
    assert text.endswith("\r" + " " * len("work: last (0 s)") + "\r")  # erased: the next line starts clean
    assert "\n" not in text


def test_silent_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Progress("work", out) as bar:
        bar.update("step", force=True)
    assert out.getvalue() == ""
