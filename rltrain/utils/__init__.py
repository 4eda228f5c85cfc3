"""Utilities shared by the trainer and workers: metrics loggers, plots, timers, memory stats, checkpoints.

No model math lives here.
"""
