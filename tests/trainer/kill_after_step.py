"""`python -m rltrain.main` that stops itself right after step N: the crash half of the kill-and-resume tests.
The stop is the trainer's `after_step` hook (PPOTrainer), installed here by the test; the trainer reads no
fault-injection switch of its own. `N` SIGKILLs the process (a crash); `N:SIGINT` interrupts it as Ctrl-C does (the
whole process group), and the resume command it prints is `python -m rltrain.main ...` (the user's command, without
N).

    python tests/trainer/kill_after_step.py N[:SIGINT] --config-name grpo_tiny key=value ... [hydra.run.dir=DIR]
"""

import functools
import os
import signal
import sys


def main() -> None:
    step, _, how = sys.argv.pop(1).partition(":")
    kill_after, sig = int(step), getattr(signal, how or "SIGKILL")
    # Ctrl-C's handler as a terminal's foreground job has it: a job started in the background by a non-interactive
    # shell (`cmd &`) inherits SIGINT ignored, and Python then leaves it ignored (the SIGINT would be lost)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # the command line rltrain sees (and prints in its resume line) is `python -m rltrain.main ...`
    sys.argv[0] = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "rltrain", "main.py")

    def after_step(step: int) -> None:
        if step != kill_after:
            return
        if sig == signal.SIGKILL:
            os.kill(os.getpid(), sig)
        else:  # as a terminal's Ctrl-C sends it: to the whole process group (the reward workers too)
            os.killpg(os.getpgrp(), sig)

    from rltrain.trainer import ppo

    # rltrain.main's run_rl imports run_from_config when it runs: it gets this one, with the hook
    ppo.run_from_config = functools.partial(ppo.run_from_config, after_step=after_step)
    from rltrain.main import main as rltrain_main

    rltrain_main()


if __name__ == "__main__":
    main()
