"""``python -m calibrate fit|report|public``. User errors (bad tables, unknown GPU keys, no data) print one line each
and exit 2, never a traceback; a fit refused for its cross-validated error exits 1 and writes nothing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from calibrate import fit as F

GIB = 1024**3
MIB = 1024**2
DEFAULT_DATA = Path("data/measurements")
DEFAULT_REPORT = Path("docs/report")


def _coefficients_dir() -> Path:
    import estimator

    return Path(estimator.__file__).resolve().parent / "coefficients"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + line otherwise)
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m calibrate",
                                     description="Fit per-GPU residual coefficients from measured runs, and report "
                                                 "the estimator's error against them (docs/calibrate.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit and export estimator/coefficients/<gpu-key>.json",
                         description="Fit the residual terms of every GPU key found (or --gpu), cross-validate "
                                     "them, and write one coefficient file per key. Export is refused when the "
                                     "device-level p95 absolute error of any CV scheme exceeds --max-cv-error-pct.")
    fit.add_argument("--data", type=Path, action="append", metavar="PATH",
                     help=f"measurements root (<gpu-key>/*.csv), one key's folder, or a CSV file; repeatable "
                          f"(default: {DEFAULT_DATA})")
    fit.add_argument("--gpu", action="append", metavar="KEY", help="fit only this GPU key (repeatable)")
    fit.add_argument("--out", type=Path, default=None, metavar="DIR",
                     help="where to write <gpu-key>.json (default: the estimator's package data, "
                          "estimator/coefficients/)")
    fit.add_argument("--max-cv-error-pct", type=float, default=F.DEFAULT_MAX_CV_ERROR_PCT, metavar="X",
                     help="refuse to export when a CV scheme's device-level p95 absolute error exceeds X %% "
                          "(default: %(default)s)")
    fit.add_argument("--upper-quantile", type=float, default=F.DEFAULT_UPPER_QUANTILE, metavar="Q",
                     help="quantile of measured/predicted device bytes that sets upper_bound_ratio "
                          "(default: %(default)s)")
    fit.add_argument("--no-build", action="store_true",
                     help="never build a missing model profile (torch); such rows are left out")
    fit.add_argument("--dry-run", action="store_true", help="fit and report, write nothing")
    report = sub.add_parser("report", help="markdown + CSV + PNG error report",
                            description="Write the error report: Table 2, Figures 8-9, Table 3 and the "
                                        "predicted-vs-measured plots, from whatever measurements exist.")
    report.add_argument("--data", type=Path, action="append", metavar="PATH",
                        help=f"measurements root or CSV file; repeatable (default: {DEFAULT_DATA})")
    report.add_argument("--out", type=Path, default=DEFAULT_REPORT, metavar="DIR",
                        help="report folder (default: %(default)s)")
    report.add_argument("--coefficients", type=Path, default=None, metavar="DIR",
                        help="folder of <gpu-key>.json to predict with (default: the estimator's shipped files)")
    report.add_argument("--no-build", action="store_true", help="never build a missing model profile (torch)")
    report.add_argument("--no-plan", action="store_true", help="skip Table 3 (runs the planner per row group)")
    public = sub.add_parser("public", help="score the estimator on published measurements (data/public/)",
                            description="Predict every complete published row for the quantity its source "
                                        "measured, beside the baselines, and write <out>/public.md (no fitting).")
    public.add_argument("--data", type=Path, default=Path("data/public/measurements.csv"), metavar="CSV",
                        help="the published-measurement table (default: %(default)s)")
    public.add_argument("--out", type=Path, default=DEFAULT_REPORT, metavar="DIR",
                        help="report folder (default: %(default)s)")
    public.add_argument("--json", action="store_true", help="print the summary and outliers as one JSON object")
    public.add_argument("--no-build", action="store_true", help="never build a missing model profile (torch)")
    public.add_argument("--no-baselines", action="store_true", help="skip the published baselines")
    public.add_argument("--fit", action="store_true",
                        help="fit the residual terms the rows identify (leave-one-source-out), write the accepted "
                             "ones to --coefficients-out and a Fit section in the report")
    public.add_argument("--coefficients-out", type=Path, default=Path("estimator/coefficients"), metavar="DIR",
                        help="where --fit writes accepted <gpu-key>.json files (default: %(default)s)")
    return parser


def run_public(args: argparse.Namespace) -> int:
    import json

    from calibrate import public as P

    rows = P.load(args.data)
    scored = P.score(rows, allow_build=not args.no_build, with_baselines=not args.no_baselines)
    path = P.write_report(rows, scored, args.out, args.data, args.argv)
    fits = []
    if args.fit:
        from calibrate import public_fit as PF

        fits = PF.fit_all(scored)
        written = PF.write_accepted(fits, args.data, args.coefficients_out)
        with path.open("a") as fh:
            fh.write("\n".join(PF.report_lines(fits, written)))
    if args.json:
        print(json.dumps(P.to_json(rows, scored), indent=1))
        return 0
    overall = P.summary(scored)[0]["ours"]
    if overall.get("n"):
        print(f"{overall['n']} rows scored: |error| median {overall['median_abs_pct']:.2f} %, "
              f"p90 {overall['p90_abs_pct']:.2f} %, max {overall['max_abs_pct']:.2f} %; "
              f"{len(P.outliers(scored))} beyond {P.OUTLIER_PCT:g} %")
    else:
        print("no scorable rows")
    for fit in fits:
        print(f"fit {fit.gpu_key} {fit.term}: {'shipped' if fit.accepted else fit.refused}")
    print(f"wrote {path}")
    return 0


def _print_fit(outcome, path: Path | None) -> None:
    c = outcome.coefficients
    doc = outcome.document["provenance"]
    rows = doc["rows"]
    print(f"{outcome.gpu_key}: {rows['fitted']['allocated']} rows fitted "
          f"({rows['emulated_fitted']} on emulated ranks; {rows['not_estimable']} not estimable)")
    print(f"  terms: cuda_context {c.cuda_context_bytes / GIB:.3f} GiB, cublas workspace {c.cublas_workspaces} x "
          f"{c.cublas_workspace_bytes / MIB:.1f} MiB, reserved slack {100 * c.reserved_slack_ratio:.2f} % + "
          f"{c.reserved_slack_bytes / MIB:.1f} MiB, nccl {c.nccl_bytes_per_communicator / GIB:.3f} GiB/communicator, "
          f"upper bound x{c.upper_bound_ratio:.4f}")
    for scheme, block in doc["cv"]["schemes"].items():
        levels = ", ".join(f"{lvl} {m['median_abs_pct']:.2f}/{m['p95_abs_pct']:.2f}/{m['max_abs_pct']:.2f} % "
                           f"under {m['worst_under_gib']:.2f} GiB" for lvl, m in block["overall"].items())
        print(f"  cv {scheme} ({len(block['per_group'])} groups; median/p95/max): {levels}")
    for scheme, why in doc["cv"]["skipped"].items():
        print(f"  cv {scheme}: skipped ({why})")
    v = doc["verdict"]
    rate = "n/a" if v["false_fit_rate"] is None else f"{100 * v['false_fit_rate']:.1f} %"
    print(f"  verdict: false-fit rate {rate} ({v['false_fits']} of {v['predicted_fit']} runs predicted to fit "
          f"ran out of memory); OOMs caught {v['ooms_caught']} of {v['runs_oom']}; bound exceeded on "
          f"{v['bound_exceeded_rows']} rows")
    if path:
        print(f"  wrote {path}")


def run_fit(args: argparse.Namespace) -> int:
    from calibrate import data as D
    from calibrate.export import fit_gpu, write
    from calibrate.terms import analytic_terms
    from estimator.hardware.gpus import get_gpu

    if args.gpu:  # aliases ("h100") name the estimator's key; an unknown one is a one-line "gpu: ..." error
        args.gpu = [get_gpu(k).key for k in args.gpu]
    table = D.load(args.data or [DEFAULT_DATA], args.gpu)
    rows = table.rows
    keys = sorted(set(rows["gpu_key"]) - set(D.NON_GPU_KEYS)) if len(rows) else []
    missing = sorted(set(args.gpu or []) - set(keys))
    if missing:
        raise ValueError(f"gpu: no measurements for {', '.join(missing)} under "
                         f"{', '.join(map(str, args.data or [DEFAULT_DATA]))}")
    if not keys:
        raise ValueError(f"data: no GPU measurements under {', '.join(map(str, args.data or [DEFAULT_DATA]))} "
                         "(the harness writes them: python -m harness ..., docs/harness.md)")
    if not 0 < args.upper_quantile < 1:
        raise ValueError(f"upper-quantile: must be in (0, 1), got {args.upper_quantile}")
    command = "python -m calibrate fit " + " ".join(args.argv)
    status = 0
    for key in keys:
        key_rows = rows[rows["gpu_key"] == key]
        key_rows = key_rows.join(analytic_terms(key_rows, allow_build=not args.no_build))
        outcome = fit_gpu(key_rows, table.files, key, quantile=args.upper_quantile,
                          max_cv_error_pct=args.max_cv_error_pct, command=command)
        for line in outcome.warnings:
            print(f"warning: {line}", file=sys.stderr)
        if outcome.document is None:
            for line in outcome.refused:
                print(f"refused: {line}", file=sys.stderr)
            status = 1
            continue
        path = None
        if not outcome.refused and not args.dry_run:
            path = write(outcome.document, args.out or _coefficients_dir())
        _print_fit(outcome, path)
        for line in outcome.refused:
            print(f"refused: {line}", file=sys.stderr)
            status = 1
    return status


def run_report(args: argparse.Namespace) -> int:
    from calibrate.report import build_report

    path = build_report(args.data or [DEFAULT_DATA], args.out, coefficients_dir=args.coefficients,
                        allow_build=not args.no_build, plan=not args.no_plan, argv=args.argv)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]
    from calibrate.data import ValidationError

    try:
        return {"fit": run_fit, "report": run_report, "public": run_public}[args.command](args)
    except ValidationError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
