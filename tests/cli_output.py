"""Reading the CLI's error output in tests: rich folds long lines (paths too) at the console width."""

from __future__ import annotations


def squash(text: str) -> str:
    return "".join(text.split())  # rich folds long lines, paths too, at the console width (80 under capture)


def cli_stderr(capsys) -> str:
    """The captured stderr, without whitespace; the CLI's errors never come with a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return squash(err)
