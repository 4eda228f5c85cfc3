"""The planner's lab: refit rltrain.plan's calibration constants from the measured runs and compare the planner with
every run (tools/planlab/fit.py).

    python tools/plan_lab.py            # the fitted constants + predicted vs measured
    python tools/plan_lab.py --write    # write the refit values into rltrain/plan/calibration.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for planlab and the harness

from planlab.fit import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
