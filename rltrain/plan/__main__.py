"""python -m rltrain.plan --config-name NAME [Hydra overrides] [--gpu-memory-gib G] [--device h100|h200] [--json]
(flags and overrides in any order)

Composes and validates the config as rltrain.main does, reads the training data's prompt lengths as the trainer does
(else plans at data.max_prompt_length and says so), and prints each GPU's peak memory by phase and part, the seconds
per step by phase and whether it fits; a GPU that will not fit: exit 2 with the cheapest keys to change. Starts
nothing, imports no GPU stack, downloads nothing (docs/plan.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from rltrain.config.entry import CONFIG_DIR, composition_error, compose_config
from rltrain.config.schema import register_configs


def _data_lengths(cfg):
    """(the training data's prompt lengths, None) or (None, why not), read as the trainer does from local files."""
    import os

    from rltrain.data.lengths import data_lengths
    from rltrain.utils.errors import find_user_error
    from rltrain.utils.hub import in_cache

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name = cfg.model.tokenizer or cfg.model.path
    if not name:
        return None, "neither model.tokenizer nor model.path names a tokenizer"
    if name != "char" and not os.path.isdir(os.path.expanduser(name)) and not in_cache(name):
        return None, f"the tokenizer {name!r} is neither a local directory nor in the Hugging Face cache"
    try:
        return data_lengths(cfg), None
    except Exception as err:  # a missing data file or tokenizer: plan at the config's bound, and say so
        user_error = find_user_error(err)
        if user_error is None:
            raise
        why = " ".join(str(user_error).split()).split(": ")[0]  # the what, without the library's long tail
        return None, why[:200] + ("..." if len(why) > 200 else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rltrain.plan", description=__doc__.split("\n\n")[1])
    ap.add_argument("--config-name", "-cn", default="grpo_tiny")
    ap.add_argument("--gpu-memory-gib", type=float, default=None,
                    help="memory of each GPU in GiB (default: the device kind's, 79.18 for h100, 139.8 for h200)")
    ap.add_argument("--device", choices=["h100", "h200"], default=None,
                    help="whose measured rates to use (default h100; h200 when --gpu-memory-gib > 100)")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="prompt length to plan for (default: the training data's, read and tokenized as the trainer "
                         "does: memory at its longest prompt, time at the mean; data.max_prompt_length when the "
                         "data cannot be read here)")
    ap.add_argument("--worst-case", action="store_true",
                    help="plan at data.max_prompt_length without reading the data (the config's bound)")
    ap.add_argument("--response-tokens", type=int, default=None,
                    help="response length to plan for (default rollout.max_response_length: the worst case)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. actor.recompute_activations=true")
    args = ap.parse_intermixed_args(argv)  # flags before, between or after the overrides

    from rltrain.config import validate_config
    from rltrain.plan import calibration as cal
    from rltrain.plan.suggest import make_plan
    from rltrain.plan.report import table, to_json
    from rltrain.utils.errors import find_user_error

    try:
        register_configs()  # the schema the recipes' defaults lists name (rltrain.main registers it at import)
        why = composition_error(CONFIG_DIR, args.config_name, ["--config-name", args.config_name, *args.overrides])
        if why is not None:  # the entry points' own gate: the same one line for a wrong type or an unknown key
            print(f"rltrain: {why}", file=sys.stderr, flush=True)
            return 2
        try:
            cfg = compose_config(args.config_name, args.overrides)  # typed: the one conversion
        except Exception as err:  # hydra's composition errors: a bad key or value, a missing config
            if find_user_error(err) is not None:
                raise
            print(f"rltrain: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            return 2
        validate_config(cfg)
        prompts, unread = None, None
        if args.prompt_tokens is None and not args.worst_case:
            prompts, unread = _data_lengths(cfg)
        plan = make_plan(cfg, gpu_memory_gib=args.gpu_memory_gib, device=args.device,
                         prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens, prompts=prompts)
        if unread:
            plan.warnings.insert(0, f"the training data could not be read here ({unread}): planned at "
                                    "data.max_prompt_length, the worst case")
    except Exception as err:
        user_error = find_user_error(err)
        if user_error is None:
            raise
        print(f"rltrain: {user_error}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print(json.dumps(to_json(plan), indent=1))
    else:
        print(table(plan))
    if not plan.fits:  # the changes were printed above (once); the exit code and one line say it did not fit
        print(f"rltrain: the plan does not fit {plan.inputs.world} x {cal.DEVICES[plan.device].name} "
              f"({plan.gpu_memory_gib:.1f} GiB each); what to change: {'the JSON message' if args.json else 'above'}",
              file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
