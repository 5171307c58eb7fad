"""A timerfd on CLOCK_MONOTONIC armed at absolute times, through libc (Python 3.11 has no
os.timerfd_*): the delay-line engine's wake-up, polled with its TAPs in one epoll."""

from __future__ import annotations

import ctypes
import math
import os

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Timer:
    """A timerfd on CLOCK_MONOTONIC armed at absolute times (Python 3.11 has no os.timerfd_*)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        create, self._settime = libc.timerfd_create, libc.timerfd_settime
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self.fd = fd
        self._spec = _Itimerspec()
        self._ptr = ctypes.pointer(self._spec)
        self.armed: float | None = None

    def arm(self, when: float | None) -> None:
        """Fire at monotonic time `when` (None: never). Re-arming drops an expiry not yet read."""
        if when == self.armed:
            return
        value = self._spec.it_value
        if when is None:
            value.tv_sec = value.tv_nsec = 0
        else:   # rounded up: woken before `when`, the loop would find nothing due and sleep again
            sec = int(when)
            nsec = math.ceil((when - sec) * 1e9)
            if nsec >= 1_000_000_000:
                sec, nsec = sec + 1, nsec - 1_000_000_000
            value.tv_sec, value.tv_nsec = sec, max(nsec, 1)
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, self._ptr, None) < 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime")
        self.armed = when

    def fired(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        self.armed = None

    def close(self) -> None:
        os.close(self.fd)
