"""Stack dumps of a live process: `kill -USR1 <pid>` makes a process that called enable_stack_dumps() print
every thread's Python stack to its stderr and go on running. A run that hangs (a collective one rank never
joins, an engine start that never returns) then says where each process waits: tools/gpu_placements.py sends
the signal to a run's driver and Ray workers before killing a run that outlived its time. No effect on Windows."""

from __future__ import annotations

import faulthandler
import signal

STACK_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)


def enable_stack_dumps() -> bool:
    """Register the dump on STACK_DUMP_SIGNAL for this process (idempotent); False where there is no such signal."""
    if STACK_DUMP_SIGNAL is None:
        return False
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    return True
