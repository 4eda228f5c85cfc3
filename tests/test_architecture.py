"""The rooms of rltrain and the lines between them, checked (docs/architecture.md, "Rules between rooms").

Every `rltrain/**/*.py` is parsed with `ast`; every import in it (module level and inside functions, `import x`,
`from x import y`, relative imports resolved) is checked against RULES, the one machine-readable copy of the
rules that docs/architecture.md mirrors (a test below keeps the two equal). Imports between rltrain modules, module
level or inside functions, must not form a cycle. A violation is reported as `file:line`, the import as written, and the rule.

KNOWN_VIOLATIONS lists, by file and imported module, the imports that break a rule today and are being removed
by the refactor of issue #32; each entry says why. An entry that no longer matches any import fails
`test_no_stale_known_violations`, so the list only shrinks. Imports by string (`importlib.import_module` of a
dotted path from the config: reward functions, advantage estimators, rollout engines, the log-prob backends) are
not seen by `ast` and not checked.

Each public name is defined once; no file of rltrain/ is over 500 lines nor a function over 90; the config is
converted to the typed schema only at the entry points (CONVERTING_FILES). Every file is read and parsed once.

The last test keeps the documentation inside the repository: no tracked file under docs/ (nor README.md) names a
path outside it, and every relative Markdown link there resolves to a file of the repository.
"""
from __future__ import annotations

import ast
import functools
import glob
import os
import re
import subprocess
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "rltrain")

# ------------------------------------------------------------------------------------------------ the rules
# Each rule: (id, kind, the modules it applies to, targets, the sentence docs/architecture.md states).
#   only      the modules may import nothing from rltrain but their own room and `targets`
#   never     the modules must not import any of `targets` (rltrain modules)
#   only-in   the third-party package(s) in the applies-to column may be imported only by the `targets` modules
# A module matches a name when it is that name or inside it (`rltrain.models` matches `rltrain.models.hf`).
ROOMS = ("algorithms", "compat", "config", "data", "models", "ops", "plan", "rewards", "rollout", "sandbox",
         "trainer", "utils", "workers")
RULES: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...], str], ...] = (
    ("compat-leaf", "only", ("rltrain.compat",), (),
     "compat/ (version shims: megatron, vLLM, Ray, torch) imports nothing else from rltrain; any room may import it"),
    ("utils-leaf", "only", ("rltrain.utils",), ("rltrain.compat",),
     "utils/ imports only rltrain.compat"),
    ("ops-pure", "only", ("rltrain.ops",), ("rltrain.compat",),
     "ops/ is tensor math: it imports only rltrain.compat"),
    ("algorithms-pure", "only", ("rltrain.algorithms",), ("rltrain.compat",),
     "algorithms/ is tensor math: it imports only rltrain.compat"),
    ("sandbox-alone", "only", ("rltrain.sandbox",), (),
     "sandbox/ imports nothing from rltrain"),
    ("data-no-models", "only", ("rltrain.data",), ("rltrain.utils", "rltrain.compat"),
     "data/ imports only utils/ and compat/ (it knows no model)"),
    ("rewards-scoring", "only", ("rltrain.rewards",), ("rltrain.data", "rltrain.utils", "rltrain.compat"),
     "rewards/ imports only data/, utils/ and compat/"),
    ("models-no-rl", "never", ("rltrain.models",),
     ("rltrain.algorithms", "rltrain.rewards", "rltrain.rollout", "rltrain.workers", "rltrain.trainer",
      "rltrain.plan"),
     "models/ knows no RL (it takes a loss_fn): no algorithms/, rewards/, rollout/, workers/, trainer/, plan/"),
    ("rollout-no-training", "never", ("rltrain.rollout",),
     ("rltrain.trainer", "rltrain.workers", "rltrain.models.megatron", "rltrain.algorithms", "rltrain.plan"),
     "rollout/ imports no training code: no trainer/, workers/, models/megatron/, algorithms/, plan/"),
    ("config-no-runtime", "never", ("rltrain.config",),
     ("rltrain.rollout", "rltrain.workers", "rltrain.trainer", "rltrain.models", "rltrain.plan"),
     "config/ validates without the runtime: no rollout/, workers/, trainer/, models/, plan/ (models/ and plan/ "
     "import config/, never the other way)"),
    ("plan-before-launch", "only", ("rltrain.plan",), ("rltrain.config", "rltrain.data", "rltrain.utils",
                                                       "rltrain.compat"),
     "plan/ (the pre-launch memory/time planner) imports only config/, data/ (the training data's prompt lengths), "
     "utils/ and compat/"),
    ("workers-below-trainer", "never", ("rltrain.workers",), ("rltrain.trainer",),
     "workers/ never imports trainer/ (the trainer composes workers)"),
    ("trainer-no-model-internals", "never", ("rltrain.trainer",), ("rltrain.models.megatron",),
     "trainer/ does not reach into models/megatron/ (engines are built by workers/ or the models/ builder)"),
    ("entry-points-on-top", "never", tuple(f"rltrain.{r}" for r in ROOMS), ("rltrain.main", "rltrain.sft"),
     "no room imports the entry points rltrain.main / rltrain.sft"),
    ("ray", "only-in", ("ray",), ("rltrain.workers.group", "rltrain.main", "rltrain.compat"),
     "ray is imported only by workers/group.py, main.py and compat/"),
    ("megatron", "only-in", ("megatron",), ("rltrain.models.megatron", "rltrain.compat"),
     "megatron (megatron-core) is imported only by models/megatron/ and compat/"),
    ("vllm", "only-in", ("vllm",), ("rltrain.rollout", "rltrain.compat"),
     "vllm is imported only by rollout/ and compat/"),
    ("triton", "only-in", ("triton",), ("rltrain.ops", "rltrain.compat"),
     "triton is imported only by ops/ and compat/"),
)

# Imports that break a rule and are being removed by a refactor: (file, imported module) -> why (the issue).
# Empty since the refactor of issue #32 landed (2026-11-25: config/validate.py stopped importing rollout/vllm.py
# and workers/placement.py; trainer/sft.py builds its engine through models/builder.py and no longer imports
# megatron). An entry is removed when its fix lands: test_no_stale_known_violations fails until then.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


# ------------------------------------------------------------------------------------------------ the scan
@dataclass(frozen=True)
class Import:
    file: str          # repository-relative path
    line: int
    source: str        # the importing module, dotted
    target: str        # the imported module, dotted and resolved (relative imports made absolute)
    text: str          # the statement as written
    module_level: bool  # executed at import time (not inside a function)


def module_name(rel_path: str) -> str:
    name = rel_path[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def python_files() -> list[str]:
    out = []
    for d, _, files in os.walk(PKG):
        out += [os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/") for f in files if f.endswith(".py")]
    return sorted(out)


def _walk(node, in_function=False):
    """Yield (node, inside a function) for every node; `if TYPE_CHECKING:` bodies count as not executed."""
    for child in ast.iter_child_nodes(node):
        func = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            func = True
        yield child, func
        yield from _walk(child, func)


@functools.lru_cache(maxsize=None)
def parsed() -> dict[str, tuple[str, ast.Module]]:
    """Each rltrain file (repository-relative) -> its text and its `ast`, read and parsed once for all the tests."""
    out = {}
    for rel in python_files():
        with open(os.path.join(ROOT, rel)) as fh:
            text = fh.read()
        out[rel] = (text, ast.parse(text, rel))
    return out


def parse_imports(rel: str, text: str, modules: set[str], tree: ast.Module | None = None) -> list[Import]:
    """Every import of one file (`rel`, repository-relative; `tree`: `text` parsed), relative imports made absolute."""
    src = module_name(rel)
    package = src if rel.endswith("__init__.py") else src.rpartition(".")[0]
    out = []
    for node, in_func in _walk(tree or ast.parse(text, rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(rel, node.lineno, src, alias.name, ast.unparse(node), not in_func))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{mod}.{alias.name}"
                out.append(Import(rel, node.lineno, src, sub if sub in modules else mod, ast.unparse(node),
                                  not in_func))
    return out


@functools.lru_cache(maxsize=None)
def scan() -> tuple[Import, ...]:
    files = parsed()
    modules = {module_name(f) for f in files}
    out = []
    for rel, (text, tree) in files.items():
        out += parse_imports(rel, text, modules, tree)
    return tuple(out)


def inside(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def room_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in ROOMS else module


def broken_rules(imp: Import) -> list[str]:
    """The ids of the rules this import breaks."""
    broken = []
    for rid, kind, applies, targets, _ in RULES:
        if kind == "only-in":
            if inside(imp.target, applies) and not inside(imp.source, targets):
                broken.append(rid)
            continue
        if not inside(imp.source, applies) or not inside(imp.target, ("rltrain",)):
            continue
        if kind == "only" and not inside(imp.target, (room_of(imp.source),) + targets):
            broken.append(rid)
        if kind == "never" and inside(imp.target, targets):
            broken.append(rid)
    return broken


def violations() -> list[tuple[Import, str]]:
    return [(imp, rid) for imp in scan() for rid in broken_rules(imp)]


def _describe(imp: Import, rid: str) -> str:
    why = next(r[4] for r in RULES if r[0] == rid)
    return f"{imp.file}:{imp.line}: `{imp.text}` imports {imp.target}: breaks rule {rid!r} ({why})"


# ------------------------------------------------------------------------------------------------ the tests
def test_the_scan_sees_every_kind_of_import():
    """Guard against a scan that silently finds nothing."""
    imps = scan()
    assert len({i.file for i in imps}) > 50
    assert any(not i.module_level for i in imps), "no function-level import found"
    assert any(i.target == "rltrain.workers.group" and i.source.startswith("rltrain.trainer") for i in imps)
    text = ("from . import b\nfrom .b import f\nfrom .. import utils\nfrom ..utils.timing import timer\n"
            "import ray.util\nif TYPE_CHECKING:\n    import vllm\ndef g():\n    from megatron.core import x\n")
    modules = {"rltrain.rollout.a", "rltrain.rollout.b", "rltrain.utils", "rltrain.utils.timing"}
    got = parse_imports("rltrain/rollout/a.py", text, modules)
    assert {i.source for i in got} == {"rltrain.rollout.a"}
    assert [(i.line, i.target, i.module_level) for i in got] == [
        (1, "rltrain.rollout.b", True), (2, "rltrain.rollout.b", True), (3, "rltrain.utils", True),
        (4, "rltrain.utils.timing", True), (5, "ray.util", True), (7, "vllm", False), (9, "megatron.core", False)]
    init = parse_imports("rltrain/rollout/__init__.py", "from .b import f\n", modules)
    assert [i.target for i in init] == ["rltrain.rollout.b"]


def test_rule_checker_on_hand_made_imports():
    def imp(source, target):
        return Import("x.py", 1, source, target, "", True)
    assert broken_rules(imp("rltrain.ops.logprob", "rltrain.utils.timing")) == ["ops-pure"]
    assert broken_rules(imp("rltrain.ops.logprob", "rltrain.compat.torch")) == []
    assert broken_rules(imp("rltrain.ops.logprob", "rltrain.ops.chunking")) == []
    assert broken_rules(imp("rltrain.sandbox.runner", "rltrain.compat")) == ["sandbox-alone"]
    assert broken_rules(imp("rltrain.config.validate", "rltrain.rollout.vllm")) == ["config-no-runtime"]
    assert broken_rules(imp("rltrain.config.validate", "rltrain.models.presets")) == ["config-no-runtime"]
    assert broken_rules(imp("rltrain.models.presets", "rltrain.config.presets")) == []
    assert broken_rules(imp("rltrain.trainer.ppo", "ray")) == ["ray"]
    assert broken_rules(imp("rltrain.workers.group", "ray.util.placement_group")) == []
    assert broken_rules(imp("rltrain.compat.ray", "ray")) == []
    assert broken_rules(imp("rltrain.trainer.sft", "megatron.core")) == ["megatron"]
    assert broken_rules(imp("rltrain.trainer.sft", "rltrain.models.megatron.engine")) == \
        ["trainer-no-model-internals"]
    assert broken_rules(imp("rltrain.trainer.sft", "rltrain.models.hf")) == []
    assert broken_rules(imp("rltrain.plan.memory", "rltrain.workers.placement")) == ["plan-before-launch"]
    assert broken_rules(imp("rltrain.rollout.hf", "rltrain.main")) == ["entry-points-on-top"]
    assert broken_rules(imp("rltrain.sft", "rltrain.main")) == []
    assert broken_rules(imp("rltrain.rollout.hf", "rayleigh")) == []  # a prefix is a dotted name, not a string


def test_rooms_import_only_across_allowed_lines():
    bad = [_describe(imp, rid) for imp, rid in violations() if (imp.file, imp.target) not in KNOWN_VIOLATIONS]
    assert not bad, "imports across a line docs/architecture.md forbids:\n" + "\n".join(bad)


def test_no_stale_known_violations():
    seen = {(imp.file, imp.target) for imp, _ in violations()}
    stale = [f"{f} -> {m} ({why})" for (f, m), why in KNOWN_VIOLATIONS.items() if (f, m) not in seen]
    assert not stale, ("these KNOWN_VIOLATIONS entries match no violating import any more; remove them from "
                       "tests/test_architecture.py:\n" + "\n".join(stale))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-import), by Tarjan's algorithm."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_on_a_hand_made_graph():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def import_graph(imports: list[Import]) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """(module -> the rltrain modules it imports, (a, b) -> where a imports b). Importing `rltrain.x.y` runs the
    package `rltrain.x`'s __init__ first, so the edge goes to every enclosing package too (not to the importer's own,
    which is already running)."""
    packages = {module_name(f) for f in python_files() if f.endswith("__init__.py")}
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for imp in imports:
        if not inside(imp.target, ("rltrain",)):
            continue
        parts = imp.target.split(".")
        enclosing = [p for p in (".".join(parts[:i]) for i in range(2, len(parts)))
                     if p in packages and not inside(imp.source, (p,))]
        for target in [imp.target] * (imp.target != imp.source) + enclosing:
            graph.setdefault(imp.source, set()).add(target)
            where.setdefault((imp.source, target),
                             f"{imp.file}:{imp.line} `{imp.text}`" + ("" if imp.module_level else " (in a function)"))
    return graph, where


def test_import_graph_runs_the_enclosing_packages():
    imps = [Import("x.py", 1, "rltrain.models.presets", "rltrain.config.schema", "", True),
            Import("y.py", 1, "rltrain.config.validate", "rltrain.config.schema", "", True)]
    graph, _ = import_graph(imps)
    assert graph == {"rltrain.models.presets": {"rltrain.config.schema", "rltrain.config"},
                     "rltrain.config.validate": {"rltrain.config.schema"}}


def test_no_import_cycles():
    """No cycle among rltrain modules, counting every import: module-level ones, the ones inside functions (a
    function-level import that closes a circle is the same knot, only tied later) and the package __init__s an
    import runs."""
    graph, where = import_graph(scan())
    cycles = _cycles(graph)
    lines = []
    for comp in cycles:
        lines.append(" <-> ".join(comp))
        lines += [f"    {where[(a, b)]}" for a in comp for b in sorted(graph.get(a, ())) if b in comp]
    assert not cycles, "import cycles among rltrain modules:\n" + "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the names
# Public top-level names several modules define on purpose, one meaning each: what every plug-in of a registry
# defines by contract (a log-prob backend's functions, a reward's compute_score, a data task's generators, an entry
# point's main/cli, a true on-policy kernel set's ops: ops/invariant.py and compat/vllm_kernels.py, and each model
# backend's make_invariant) and module loggers.
PROTOCOL_NAMES = {"backward", "forward_stats", "is_available", "compute_score", "main", "cli", "log", "logger",
                  "make_splits", "write_splits", "rl_row", "attention", "linear", "rms_norm", "make_invariant"}
# Duplicates a refactor is removing: name -> why (the issue); an entry that matches no duplicate fails the test.
KNOWN_DUPLICATES: dict[str, str] = {}


def public_names() -> dict[str, list[str]]:
    """Each public top-level name of rltrain (function, class, assigned name) -> the files that define it."""
    out: dict[str, list[str]] = {}
    for rel, (_, tree) in parsed().items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            for name in names:
                if not name.startswith("_"):
                    out.setdefault(name, []).append(rel)
    return out


def test_each_public_name_is_defined_once():
    dups = {n: files for n, files in public_names().items() if len(files) > 1 and n not in PROTOCOL_NAMES}
    bad = [f"{n}: {', '.join(files)}" for n, files in sorted(dups.items()) if n not in KNOWN_DUPLICATES]
    assert not bad, "public names defined in more than one module (give each meaning its own name):\n" + "\n".join(bad)
    stale = [n for n in KNOWN_DUPLICATES if n not in dups]
    assert not stale, f"KNOWN_DUPLICATES entries that are no longer duplicated; remove them: {stale}"


# ------------------------------------------------------------------------------------------------ sizes
MAX_FILE_LINES = 500      # docs/architecture.md and HELPER_RULES: no file of rltrain/ over 500 lines
MAX_FUNCTION_LINES = 90   # nor a function (or method) over 90, decorators and docstring included


def oversized(files: dict[str, tuple[str, ast.Module]]) -> list[str]:
    """`file: N lines` for each file over MAX_FILE_LINES, `file:line name: N lines` for each function over
    MAX_FUNCTION_LINES (a nested function counts in its own right and inside its parent)."""
    out = []
    for rel, (text, tree) in files.items():
        n = len(text.splitlines())
        if n > MAX_FILE_LINES:
            out.append(f"{rel}: {n} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n = node.end_lineno - first + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNCTION_LINES})")
    return out


def test_size_checker_on_hand_made_files():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 2))
    ok = f"@dec\ndef f():\n{body}"  # the decorator, the def and the body: exactly MAX_FUNCTION_LINES
    long = f"@dec\ndef g():\n{body}    return 0\n"
    files = {"ok.py": (ok, ast.parse(ok)), "long.py": (long, ast.parse(long)),
             "big.py": ("\n" * (MAX_FILE_LINES + 1), ast.parse(""))}
    assert oversized(files) == [f"long.py:2 g: {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})",
                                f"big.py: {MAX_FILE_LINES + 1} lines (at most {MAX_FILE_LINES})"]


def test_no_file_or_function_over_the_size_limits():
    bad = oversized(parsed())
    assert not bad, "split these (one concern per function, per file):\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------------------ the config read once
# The composed config becomes the typed schema once, at an entry point (config/convert.py's as_config): rltrain.main's
# run_entry (rltrain.main, rltrain.sft) and config/entry.py (compose_config for python -m rltrain.plan and the tools,
# the gate that refuses a bad command line). Everything after takes typed objects.
CONVERTERS = ("as_config", "OmegaConf.structured", "OmegaConf.to_object")
CONVERTING_FILES = ("rltrain/config/convert.py", "rltrain/config/entry.py", "rltrain/main.py", "rltrain/export.py")


def conversions(files: dict[str, tuple[str, ast.Module]]) -> list[str]:
    """`file:line call` for each call of a CONVERTERS function outside CONVERTING_FILES."""
    out = []
    for rel, (_, tree) in files.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in CONVERTERS and rel not in CONVERTING_FILES:
                out.append(f"{rel}:{node.lineno} {ast.unparse(node.func)}(...)")
    return out


def test_the_config_is_converted_only_at_the_entry_points():
    assert conversions({"rltrain/x.py": ("", ast.parse("from a import as_config\ndef f(c):\n    return as_config(c)"
                                                        ))}) == ["rltrain/x.py:3 as_config(...)"]
    bad = conversions(parsed())
    assert not bad, ("the config is converted to the typed schema only at the entry points (" +
                     ", ".join(CONVERTING_FILES) + "); pass the typed config down instead:\n" + "\n".join(bad))


# ------------------------------------------------------------------------------------------------ the docs
def rules_markdown() -> str:
    """The table docs/architecture.md carries, generated from RULES."""
    kinds = {"only": "may import from rltrain only", "never": "must not import", "only-in": "imported only by"}
    rows = ["| rule | applies to | kind | modules | the rule |", "|---|---|---|---|---|"]
    for rid, kind, applies, targets, why in RULES:
        applies_s = "every room" if applies == tuple(f"rltrain.{r}" for r in ROOMS) else ", ".join(applies)
        rows.append(f"| `{rid}` | {applies_s} | {kinds[kind]} | {', '.join(targets) or '(nothing)'} | {why} |")
    return "\n".join(rows) + "\n"


def test_docs_architecture_mirrors_the_rules_table():
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        doc = f.read()
    assert rules_markdown() in doc, ("docs/architecture.md's rules table differs from RULES in "
                                     "tests/test_architecture.py; paste this table into the doc:\n" + rules_markdown())
    for (f, m), _ in KNOWN_VIOLATIONS.items():
        assert f"`{f}` -> `{m}`" in doc, f"docs/architecture.md does not list the known violation {f} -> {m}"


OUTSIDE = [
    (re.compile(r"\.\./shared\b|(?<![\w.])/work/"), "a path of the machine the docs were written on"),
    (re.compile(r"\bDESIGN\.md\b|\bSTYLE\.md\b|\bMETHOD\.md\b|\.library/"), "a document outside the repository"),
    (re.compile(r"\bgpu_stage\.sh\b"), "a staging script outside the repository"),
    (re.compile(r"\]\((?:file:|/)"), "an absolute link"),
]
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# a path the docs name inside docs/ or the results tables: it must exist; `{md,json}` and `*` expand
REPO_PATH = re.compile(r"(?<![\w./-])((?:docs|tools/results)/[\w./{},*-]*)")


def doc_files() -> list[str]:
    return subprocess.run(["git", "ls-files", "docs", "README.md"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


def _named_paths_exist(path: str) -> bool:
    if "{" in path and "}" in path:
        head, rest = path.split("{", 1)
        options, tail = rest.split("}", 1)
        return all(_named_paths_exist(head + o + tail) for o in options.split(","))
    full = os.path.join(ROOT, path)
    return bool(glob.glob(full)) if "*" in path else os.path.exists(full)


def doc_problems(rel: str, lines: list[str]) -> list[str]:
    """Each line of the doc `rel` that names a path outside the repository, links out of it or to no file."""
    bad = []
    folder = os.path.dirname(os.path.join(ROOT, rel))
    for n, line in enumerate(lines, 1):
        for pattern, what in OUTSIDE:
            if pattern.search(line):
                bad.append(f"{rel}:{n}: {what}: {line.strip()[:120]}")
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            resolved = os.path.normpath(os.path.join(folder, target))
            if not resolved.startswith(ROOT + os.sep) or not os.path.exists(resolved):
                bad.append(f"{rel}:{n}: link to {target!r} leaves the repository or names no file")
        for named in REPO_PATH.findall(line):
            named = named.rstrip(".,:;")
            if not _named_paths_exist(named):
                bad.append(f"{rel}:{n}: names {named!r}, which is not in the repository")
    return bad


def test_doc_checker_on_hand_made_lines():
    ok = ["see [the index](benchmarks.md) and `tools/results/{kernel,update}.jsonl`",
          "rows: `tools/results/*.jsonl`; https://example.org/a.md; `--out /tmp/x`; /mnt/shared/ckpt"]
    assert doc_problems("docs/x.md", ok) == []
    bad = ["follows `DESIGN.md`", "bash ../shared/tools/gpu_stage.sh", "per /work/.library/device/METHOD.md",
           "[up](../../outside.md)", "[gone](benchmarks/1999-01-01-nothing.md)", "raw: `docs/gpu_results/a.json`"]
    assert [int(p.split(":")[1]) for p in doc_problems("docs/x.md", bad)] == [1, 2, 2, 3, 3, 4, 5, 6]


def test_docs_point_only_inside_the_repository():
    files = doc_files()
    assert "README.md" in files and "docs/architecture.md" in files
    bad = []
    for rel in files:
        path = os.path.join(ROOT, rel)
        if not os.path.exists(path):  # deleted in the working tree, not yet committed
            continue
        try:
            with open(path, encoding="utf-8") as f:
                bad += doc_problems(rel, f.read().split("\n"))
        except UnicodeDecodeError:  # an image
            continue
    assert not bad, "docs that point outside the repository:\n" + "\n".join(bad)


if __name__ == "__main__":  # print the table for docs/architecture.md
    print(rules_markdown())
    for imp, rid in violations():
        print(_describe(imp, rid))
