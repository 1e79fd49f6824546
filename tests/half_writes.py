"""A filesystem whose writes fail half way, as a crash or a full disk would, for the tests of atomic writes."""

from __future__ import annotations


class HalfWriter:
    """A file that writes the first half of what it is given, then fails; `partial` lists what it wrote."""

    def __init__(self, f, partial: list[int]):
        self.f, self.partial = f, partial

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()
        return False

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.partial.append(len(data) // 2)
        raise OSError("injected failure mid-write")


def fail_writes_half_way(monkeypatch, fs) -> list[int]:
    """Every file `fs` opens for writing from now on (until monkeypatch.undo) fails half way; returns the list of
    byte counts written before each failure."""
    real_open, partial = type(fs).open, []

    def open_(self, path, mode="rb", **kwargs):
        f = real_open(self, path, mode, **kwargs)
        return HalfWriter(f, partial) if "w" in mode else f

    monkeypatch.setattr(type(fs), "open", open_)
    return partial
