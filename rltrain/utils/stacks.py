"""Stack dumps of a live process: `kill -USR1 <pid>` makes a process that called enable_stack_dumps() print
every thread's Python stack to its stderr and go on running. A run that hangs (a collective one rank never
joins, an engine start that never returns) then says where each process waits: tools/gpu_placements.py sends
the signal to a run's driver and Ray workers before killing a run that outlived its time. No effect on Windows."""

from __future__ import annotations

import faulthandler
import io
import signal
import sys

STACK_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)


def enable_stack_dumps() -> bool:
    """Register the dump on STACK_DUMP_SIGNAL for this process (idempotent), written to the process's own stderr
    (file descriptor 2, also where sys.stderr was replaced by one without a descriptor, as under pytest's
    capture). A debugging aid: False, and nothing else, where it cannot be set up."""
    if STACK_DUMP_SIGNAL is None:
        return False
    try:
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.__stderr__ or sys.stderr, all_threads=True)
    except (AttributeError, ValueError, RuntimeError, io.UnsupportedOperation):
        return False
    return True
