"""cupy.cuda.runtime for the stand-in: the emulator is one device."""


def getDeviceCount() -> int:  # noqa: N802 - CuPy's name
    return 1
