"""The planner's lab (tools only; rltrain never imports it): the calibration harness that solves
rltrain/plan/calibration.py's fitted constants from the measured runs of the results tables and scores the planner on
the others (cases.py, fit.py), the GRPO scaling model of issue 22 (scaling.py, scaling_inputs.py) and the learning
recipe's stage estimates (learn.py). Run through tools/plan_lab.py.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
