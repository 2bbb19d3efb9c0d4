"""Calibration: fit per-GPU residual coefficients from measured runs and report the estimator's error
(``python -m calibrate fit|report``; docs/calibrate.md). Reads the harness's tables as files and calls the
estimator for every analytical term: it never imports the harness, and re-implements nothing."""
