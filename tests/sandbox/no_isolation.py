"""Runs a command as on a machine without unprivileged user namespaces or Landlock: a seccomp filter makes
unshare(2) fail (EPERM) and the Landlock syscalls look absent (ENOSYS) for it and all it starts.

Used by test_isolation_required.py, and by hand to check that the suite passes on such a machine
(the sandbox refuses, the tests that need it skip saying why):

    python tests/sandbox/no_isolation.py .venv/bin/python -m pytest -q tests/sandbox
"""

import errno
import os
import sys

import pyseccomp

LANDLOCK_SYSCALLS = (444, 445, 446)  # landlock_create_ruleset, _add_rule, _restrict_self (every architecture)


def main() -> None:
    flt = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    flt.add_rule(pyseccomp.ERRNO(errno.EPERM), "unshare")
    for nr in LANDLOCK_SYSCALLS:
        flt.add_rule(pyseccomp.ERRNO(errno.ENOSYS), nr)
    flt.load()
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
