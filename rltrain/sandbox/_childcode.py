"""The child's program: a short `python -c` stub, and its code compiled once per trainer process.

Compiling the bootstrap and its two helper modules (~700 lines) took ~20-40 ms of every call; the parent now
compiles them once and keeps the marshalled code objects in a private file (mode 0600 in a 0700 directory),
which the stub loads before anything else. Where that file is gone the stub compiles from the sources.
"""

from __future__ import annotations

import atexit
import marshal
import os
import shutil
import tempfile
import threading

SANDBOX_DIR = os.path.dirname(os.path.abspath(__file__))
MODULES = ("_bootstrap", "_kernel", "_audit")

# The stub runs the bootstrap's code as __main__ (which runs main()); HELPER_CODES gives it the helpers'.
STUB = """\
import json, marshal, sys
cfg = json.loads(sys.argv[1])
try:
    with open(cfg["code_file"], "rb") as f:
        HELPER_CODES = marshal.load(f)
except Exception:
    HELPER_CODES = {}
if "_bootstrap" not in HELPER_CODES:
    with open(cfg["sandbox_dir"] + "/_bootstrap.py", encoding="utf-8") as f:
        HELPER_CODES["_bootstrap"] = compile(f.read(), cfg["sandbox_dir"] + "/_bootstrap.py", "exec")
exec(HELPER_CODES.pop("_bootstrap"))
"""

_lock = threading.Lock()
_path: list[str] = []  # the current code file, once written


def code_file() -> str:
    """The path of the marshalled code (written on first use, and again if something removed it)."""
    with _lock:
        if _path and os.path.exists(_path[0]):
            return _path[0]
        codes = {}
        for name in MODULES:
            source_path = os.path.join(SANDBOX_DIR, name + ".py")
            with open(source_path, encoding="utf-8") as f:
                codes[name] = compile(f.read(), source_path, "exec", dont_inherit=True)
        directory = tempfile.mkdtemp(prefix="rltrain-sandbox-code-")
        path = os.path.join(directory, "child.marshal")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            marshal.dump(codes, f)
        atexit.register(shutil.rmtree, directory, True)
        _path[:] = [path]
        return path
