"""Ray shims: a local cluster on loopback only, its authentication token readable by this user only. Ray reads its
multi-node switch once, at import; a process that imported Ray before setting it needs the constant patched. It must
not start or join a cluster (workers/group.py does).
"""

from __future__ import annotations

import os
import stat
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


def keep_auth_token_private() -> str | None:
    """Before this process starts a local cluster: Ray's token file (`RAY_AUTH_TOKEN_PATH` or ~/.ray/auth_token, which
    Ray writes with the umask: readable by every local user under the usual 022, which would defeat its token
    authentication) made with Ray's generator or kept at mode 0600, its directory this user's only. Ray decides
    whether the cluster uses it (RAY_AUTH_MODE; Ray 2.60 turns it on for a cluster `ray.init()` starts; the mode
    must be set before Ray reads its config, so it is left to the user). Returns the token file; None where Ray has
    no token authentication, it is disabled, or the token is given in RAY_AUTH_TOKEN."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled" or os.environ.get("RAY_AUTH_TOKEN"):
        return None
    try:
        from ray._private.authentication.authentication_token_generator import generate_new_authentication_token
    except ImportError:  # a Ray without token authentication
        return None
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=0o700, exist_ok=True)
    if os.stat(folder).st_uid == os.geteuid():
        os.chmod(folder, 0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(path, 0o600)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(generate_new_authentication_token())
    return path


RAY_START_ATTEMPTS = 3


def init_local_ray(ray_init, **kw):
    """ray_init(address="local", **kw) (ray.init: a new local cluster), again up to RAY_START_ATTEMPTS times in all
    when Ray gives up on its own node's start-up: it waits a fixed 30 s for the raylet to register with the GCS
    (ray/_private/node.py), which a loaded machine (two cores starting several runs at once) can miss."""
    import ray

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            return ray_init(address="local", **kw)
        except Exception as err:  # Ray raises a bare Exception for it
            if "timed out during startup" not in str(err) or attempt == RAY_START_ATTEMPTS:
                raise
            ray.shutdown()
            print(f"rltrain: Ray's local node did not start in its 30 s (attempt {attempt} of {RAY_START_ATTEMPTS}; "
                  "a loaded machine?): starting it again", file=sys.stderr, flush=True)
