"""`python -m rltrain.main` that SIGKILLs itself right after step N: the crash half of the kill-and-resume tests.
The kill is the trainer's `after_step` hook (PPOTrainer), installed here by the test; the trainer reads no
fault-injection switch of its own.

    python tests/trainer/kill_after_step.py N --config-name grpo_tiny key=value ... hydra.run.dir=DIR
"""

import functools
import os
import signal
import sys


def main() -> None:
    kill_after = int(sys.argv.pop(1))

    def after_step(step: int) -> None:
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    from rltrain.trainer import ppo

    # rltrain.main's run_rl imports run_from_config when it runs: it gets this one, with the hook
    ppo.run_from_config = functools.partial(ppo.run_from_config, after_step=after_step)
    from rltrain.main import main as rltrain_main

    rltrain_main()


if __name__ == "__main__":
    main()
