"""Ray shims: a local cluster on loopback only. Ray reads its multi-node switch once, at import; a process that
imported Ray before setting it needs the constant patched. It must not start or join a cluster (workers/group.py does).
"""

from __future__ import annotations

import os
import sys

# Ray treats a node as single-machine (loopback address, services bound to 127.0.0.1) when multi-node
# clusters are switched off, as it does on macOS/Windows; a local cluster of ours never takes other nodes.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def loopback_ray() -> None:
    """Make Ray started or joined from this process use 127.0.0.1 (call before starting a local cluster)."""
    os.environ.update(LOOPBACK_ENV)
    if "ray" in sys.modules:  # imported before the variable was set: Ray reads it once, at import
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
