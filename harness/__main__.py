"""``python -m harness model=... method=... training.micro_batch_size=...`` (Hydra; ``-m`` for sweeps).

The only module that sees a DictConfig: the composed config becomes (RunSpec, HarnessOptions) and
``harness.launch.run_point`` takes it from there. User errors (a typo'd key, a bad type, a value RunSpec
rejects, a point that cannot run here) print one line naming the key and exit with code 2, no traceback;
``HYDRA_FULL_ERROR=1`` restores Hydra's full report.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from harness.config import register_configs, to_run

EXIT_USAGE = 2
register_configs()


def config_error_line(err: BaseException) -> str | None:
    """One line naming the key for a composition / validation error, or None for anything else."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None)
        message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return f"{key}: {message}" if key else message
    if isinstance(err, MissingConfigException):
        group = (err.missing_cfg_file or "config").split("/")[0]
        options = f" (available: {', '.join(err.options)})" if err.options else ""
        first = str(err).strip().splitlines()[0]
        return f"{group}: {first.split(': ', 1)[-1]}{options}"
    if isinstance(err, (ConfigCompositionException, OverrideParseException)):
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        return " ".join(lines[:2]) if lines else type(err).__name__
    return None


def _one_line_config_errors() -> None:
    """Wrap Hydra's error reporter so config errors are one line and exit 2 (Hydra prints several and exits 1)."""
    import hydra._internal.utils as hydra_utils

    original = hydra_utils.run_and_report
    if getattr(original, "_harness", False):
        return

    def run_and_report(func: Any) -> Any:
        try:
            return func()
        except Exception as err:  # noqa: BLE001 - classified below; anything else goes to Hydra's reporter
            line = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else config_error_line(err)
            if line is None:
                error = err

                def reraise() -> Any:
                    raise error
                return original(reraise)
            print(f"error: {line}", file=sys.stderr)
            sys.exit(EXIT_USAGE)

    run_and_report._harness = True  # type: ignore[attr-defined]
    hydra_utils.run_and_report = run_and_report


def _hydra_context() -> tuple[bool, str | None, str]:
    """(multirun?, job output dir, overrides as YAML)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    overrides = OmegaConf.to_yaml(OmegaConf.create(list(hc.overrides.task)))
    return hc.mode == RunMode.MULTIRUN, hc.runtime.output_dir, overrides


@hydra.main(version_base="1.3", config_path="../conf", config_name="measure")
def measure(cfg: DictConfig) -> dict[str, Any]:
    """Hydra's task function: one point."""
    from harness.files import write_json
    from harness.launch import run_point

    multirun, output_dir, overrides = _hydra_context()
    try:
        spec, opts = to_run(cfg)
        record = run_point(spec, opts, extra_files={"overrides.yaml": overrides})
    except ValueError as err:
        if not multirun:  # a single run: the user's typo, one line, exit 2
            print(f"error: {err}", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        print(f"invalid point: {err}", file=sys.stderr)  # sweeps are validated up front; never kill a sweep
        result = {"status": "invalid", "error": str(err)}
    else:
        run_dir = os.path.join(opts.paths.results_dir, opts.campaign, record.gpu_key, record.run_id)
        result = {"status": record.status, "run_id": record.run_id, "run_dir": os.path.abspath(run_dir),
                  "peak_allocated_bytes": record.peak_allocated_bytes}
    if output_dir:
        write_json(os.path.join(output_dir, "point.json"), result)
    return result


def main() -> None:
    _one_line_config_errors()
    measure()


if __name__ == "__main__":
    main()
