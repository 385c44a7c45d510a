"""cupy.cuda for the stand-in: one emulated device; streams are accepted and ignored (launches run in order)."""

from __future__ import annotations

from typing import Any

from . import runtime  # noqa: F401


class Device:
    def __init__(self, device: int = 0):
        self.id = device

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class Stream:
    def __init__(self, *args: Any, **kwargs: Any):
        self.ptr = 0

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


ExternalStream = Stream


def get_current_stream() -> Stream:
    return Stream()
