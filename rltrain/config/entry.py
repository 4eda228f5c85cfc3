"""The entry points' config gate: a composed config that Hydra or the schema refuses (a wrong type, an unknown key,
`+actor.foo=1` that Hydra would accept and the run ignore) ends as one line and exit code 2, like every other
mistake a user can make (rltrain/main.py, rltrain/sft.py).

Hydra itself reports a composition error with exit code 1, the code of a crash; `config_main` composes the
command line's config once with Hydra's compose API before Hydra's own main runs, so the mistake is caught first.
It also resolves the run directory Hydra would make (`hydra.run.dir`, `${now:...}` included), has it checked before
Hydra writes `.hydra/` and its log there (utils/rundir.prepare_run_dir: not another user's, not writable by others,
no planted links, writable) and pins it on the command line, so Hydra writes into the directory that was checked;
`trainer.resume=auto` on the command line pins the stopped run it continues instead (_run_to_continue).
It must not run anything: composition, the schema and that check only.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Sequence

from rltrain.config.schema import RLConfig, register_configs
from rltrain.utils.errors import UserError

# the recipes (configs/*.yaml): the one place their folder is named
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def compose_config(config_name: str, overrides: Sequence[str] = (), schema: type = RLConfig) -> Any:
    """The config `python -m rltrain.main --config-name NAME OVERRIDES` runs with (rltrain.sft's: schema=SFTConfig),
    composed with Hydra's compose API from configs/ (the schema registered; `hydra.*` overrides, which only steer
    Hydra's own run, dropped) and converted to the typed `schema` once (config/convert.py: an unknown key raises
    ConfigError), for tools and the planner that need it without starting a run. Not validated."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rltrain.config.convert import as_config

    register_configs()
    GlobalHydra.instance().clear()  # a caller under Hydra or an earlier compose left it initialized
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            cfg = compose(config_name=config_name,
                          overrides=[o for o in overrides if not o.lstrip("+~").startswith("hydra.")])
    finally:
        GlobalHydra.instance().clear()
    return as_config(cfg, schema)


def _single_run_args(argv: list[str]):
    """Hydra's parsed command line `argv`, or None for what is not a single run (help, info, a multirun) or does not
    parse (argparse has printed its usage; Hydra will refuse the same way)."""
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return None
    if args.help or args.hydra_help or args.shell_completion or args.info or args.multirun:
        return None
    return args


def composition_error(config_dir: str, config_name: str, argv: list[str], schema: type = RLConfig) -> str | None:
    """Why the config `argv` (Hydra's command line) composes to is refused (None: it composes and fits `schema`)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf.errors import OmegaConfBaseException

    from rltrain.config.convert import as_config

    args = _single_run_args(argv)
    if args is None:
        return None
    overrides = [o for o in args.overrides if not o.lstrip("+~").startswith("hydra.")]
    try:
        with initialize_config_dir(config_dir=args.config_dir or config_dir, version_base=None):
            cfg = compose(config_name=args.config_name or config_name, overrides=overrides)
        as_config(cfg, schema)
    except OmegaConfBaseException as err:
        return schema_message(err, schema)
    except UserError as err:  # as_config: a key the schema does not have
        return str(err)
    except Exception as err:  # Hydra's own: a missing config group option, a malformed override
        if not type(err).__module__.startswith("hydra"):
            raise
        if isinstance(err.__cause__, OmegaConfBaseException):  # e.g. a value of the wrong type
            return schema_message(err.__cause__, schema)
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    finally:
        GlobalHydra.instance().clear()
    return None


def schema_message(err: Exception, schema: type = RLConfig) -> str:
    """One line for an OmegaConf error: the key it names and what is wrong with it (an unknown key: the nearest
    keys `schema` has)."""
    from rltrain.config.convert import unknown_key_message

    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if type(err).__name__ in ("ConfigKeyError", "ConfigAttributeError") and key and " not in " in first:
        return unknown_key_message(str(key), schema)
    return f"{key}: {first}" if key else first


_PINNED: list[str] = []  # the run directory entry() resolved from the recipe and put on the command line


def run_dir_pinned() -> bool:
    """Whether this process's run directory is the recipe's (Hydra's `outputs/<experiment>/<time>`), resolved and
    pinned by config_main, rather than one the user gave with hydra.run.dir."""
    return bool(_PINNED)


def pin_run_dir(config_dir: str, config_name: str, argv: list[str], job: str) -> list[str]:
    """`argv` with `hydra.run.dir=<the directory Hydra would make>` in place of any given, after that directory was
    made and checked (utils/rundir.prepare_run_dir; its UserError propagates). Unchanged for a multirun or a
    hydra.run.dir that does not resolve here (Hydra makes it; the entry point checks it before writing)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from rltrain.utils.rundir import prepare_run_dir

    args = _single_run_args(argv)
    if args is None or args.cfg:  # --cfg prints the config and runs nothing
        return argv
    register_configs()
    try:
        with initialize_config_dir(config_dir=args.config_dir or config_dir, version_base=None):
            cfg = compose(config_name=args.config_name or config_name, overrides=args.overrides,
                          return_hydra_config=True)
        run_dir = os.path.abspath(str(OmegaConf.select(cfg, "hydra.run.dir", throw_on_resolution_failure=True)))
    except Exception:  # noqa: BLE001 (an interpolation only Hydra's run resolves: Hydra decides the directory)
        return argv
    finally:
        GlobalHydra.instance().clear()
    given = [a for a in argv if a.lstrip("+~").startswith("hydra.run.dir=")]
    continued = None if given else _run_to_continue(cfg, args.overrides, run_dir)
    run_dir = continued or run_dir
    prepare_run_dir(run_dir, job)
    if not given and not continued:
        _PINNED.append(run_dir)
    quoted = run_dir.replace("\\", "\\\\").replace("'", "\\'")
    return [a for a in argv if a not in given] + [f"hydra.run.dir='{quoted}'"]


def _run_to_continue(cfg: Any, overrides: Sequence[str], fresh_dir: str) -> str | None:
    """`trainer.resume=auto` typed on the command line, without hydra.run.dir, continues the newest unfinished run
    of the experiment (utils/rundir.find_previous_run: a sibling of the fresh `outputs/<experiment>/<time>`) in its
    own directory, unless trainer.resume_in_place=false (then rltrain/main.py continues it into the fresh one).
    Returns that run's directory, or None."""
    from omegaconf import OmegaConf

    from rltrain.utils.rundir import find_previous_run

    typed = [o.lstrip("+~") for o in overrides]
    if (not any(o.startswith("trainer.resume=") for o in typed) or OmegaConf.select(cfg, "trainer.resume") != "auto"
            or OmegaConf.select(cfg, "trainer.resume_in_place") is not True
            or OmegaConf.select(cfg, "trainer.ckpt_dir")):
        return None  # not asked for, asked into a new directory, an SFT run, or checkpoints kept elsewhere
    run = {"model": OmegaConf.to_container(cfg.model, resolve=True),
           "trainer": {"experiment_name": OmegaConf.select(cfg, "trainer.experiment_name")}}
    found = find_previous_run(fresh_dir, run)
    if found is None:
        return None
    prev, step, _ = found
    print(f"rltrain: trainer.resume=auto: continuing the run in {prev} from its checkpoint of step {step}, in its "
          "directory (trainer.resume_in_place=false continues it in a new one)", file=sys.stderr, flush=True)
    return prev


def config_main(config_dir: str, config_name: str, schema: type = RLConfig) -> Callable:
    """hydra.main(version_base=None, config_path=config_dir, config_name=config_name) with the gate in front: a
    refused config, or a run directory that fails its check (pin_run_dir), prints `rltrain: <why>` and exits with
    code 2 before Hydra starts the task or writes anything."""
    import hydra

    def decorate(task: Callable[[Any], None]) -> Callable[[], None]:
        hydra_task = hydra.main(version_base=None, config_path=config_dir, config_name=config_name)(task)
        job = os.path.splitext(os.path.basename(getattr(sys.modules.get(task.__module__), "__file__", "") or ""))[0]

        @functools.wraps(task)
        def entry() -> None:
            why = composition_error(config_dir, config_name, sys.argv[1:], schema)
            if why is None and os.environ.get("RANK", "0") == "0":
                try:
                    sys.argv[1:] = pin_run_dir(config_dir, config_name, sys.argv[1:], job or "main")
                except UserError as err:
                    why = str(err)
            if why is not None:
                print(f"rltrain: {why}", file=sys.stderr, flush=True)
                sys.exit(2)
            hydra_task()

        return entry

    return decorate
