"""`hf-concept fit-scaling RUNS.csv [--law main|decay] [--predict K=V,...]`: fit DLCM's scaling laws.

`--law main` fits eq. 22, L(N, D, R, P), to columns N, D, R, P, loss; `--law decay` fits eq. 23 to either
N, R, loss_stable, loss_decayed (one row per run) or run, N, R, D, loss (trajectories). Prints the fitted
parameters, R², and the prediction for each `--predict`. A user error — including degenerate input (a
constant loss column, too few rows for the parameters) — prints one line to stderr and exits with status 2,
without a traceback. The main law's random starts follow `--seed`: one file and seed give one fit. A fit
that ran but should not be trusted (R² below `scaling.MIN_GOOD_R2`, or parameters stopped at the search
box's edge) prints its result and one warning line on stderr (also in `--json` and `--save`, under
"warnings"), with status 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _config(text: str) -> dict[str, float]:
    config = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            config[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(
                f"--predict={text!r} must be NAME=NUMBER pairs separated by commas"
            )
    return config


def _window(text: str) -> tuple[float, float]:
    try:
        start, end = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--decay-window={text!r} must be START,END fractions") from None
    return start, end


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fit-scaling",
        help="Fit DLCM's compression-aware scaling law (eq. 22) or decay law (eq. 23) to a CSV of runs.",
        description="Main law columns: N, D, R, P, loss. Decay law columns: N, R, loss_stable, loss_decayed "
        "(one row per run) or run, N, R, D, loss (trajectories; the window is read off each run). A "
        "constant loss or too few rows is refused (exit 2); a fit with R^2 below 0.9 or parameters at the "
        "edge of the search box prints a warning on stderr.",
    )
    parser.add_argument("runs", type=Path, help="CSV file with a header row.")
    parser.add_argument("--law", choices=("main", "decay"), default="main")
    parser.add_argument(
        "--predict",
        type=_config,
        action="append",
        default=[],
        help="A configuration to predict, e.g. N=2.3e9,D=1e12,R=4,P=0.6 (main) or N=1e9,R=4,loss_stable=2.5 "
        "(decay); may be repeated.",
    )
    parser.add_argument(
        "--decay-window",
        type=_window,
        default=(0.90, 0.99),
        help="Decay window as fractions of D (0.90,0.99).",
    )
    parser.add_argument("--restarts", type=int, default=256, help="Random starts screened (main law).")
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of the random starts (main law); one seed, one fit."
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of text.")
    parser.add_argument(
        "--save",
        type=Path,
        default=None,
        help="Also write the fit to this JSON law file (what `hf-concept plan --law` reads).",
    )


def run(args: argparse.Namespace) -> int:
    from hf_concept.scaling import fit_scaling_csv, save_fit

    options = {"restarts": args.restarts, "seed": args.seed} if args.law == "main" else {}
    try:
        fit = fit_scaling_csv(args.runs, law=args.law, window=args.decay_window, **options)
        predictions = [(config, fit.predict(**config)) for config in args.predict]
        if args.save is not None:
            save_fit(fit, args.save, source=str(args.runs))
    except (ValueError, OSError) as error:
        print(f"hf-concept fit-scaling: error: {error}", file=sys.stderr)
        return 2
    if fit.warnings:
        hint = (
            f"more --restarts (now {args.restarts}), another --seed, or runs spanning more N, D and R"
            if fit.law == "main"
            else "runs spanning more N, R and loss_stable"
        )
        print(
            f"hf-concept fit-scaling: warning: {args.runs}: do not trust this fit: "
            f"{'; '.join(fit.warnings)}; try {hint}",
            file=sys.stderr,
        )
    if args.json:
        report = {"law": fit.law, "rows": fit.rows, "params": fit.params, "r2": fit.r2, **fit.extra}
        report["warnings"] = fit.warnings
        report["predictions"] = [{"config": config, "value": value} for config, value in predictions]
        print(json.dumps(report, indent=2))
        return 0
    equation = "eq. 22, loss" if fit.law == "main" else "eq. 23, delta_decay"
    print(f"law: {fit.law} ({equation}); rows: {fit.rows}")
    for name, value in fit.params.items():
        print(f"  {name:<10} = {value:.6g}")
    print(f"R^2 = {fit.r2:.6f}" + (" (on log delta)" if fit.law == "decay" else ""))
    for name, value in fit.extra.items():
        print(f"{name} = {value:.6f}")
    quantity = "loss" if fit.law == "main" else "delta_decay"
    for config, value in predictions:
        settings = ", ".join(f"{name}={number:g}" for name, number in config.items())
        print(f"predict {settings}: {quantity} = {value:.6g}")
    return 0
