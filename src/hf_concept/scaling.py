"""Fit DLCM's compression-aware scaling law (paper eq. 22) and its decay-phase law (eq. 23) to runs.

Main law, eq. 22 (shared exponents δ1, δ2, γ, α; one parameter set for every run)::

    L(N, D, R, P) = E0 + A_token / (N·(1 − P) + t_token)^δ1
                       + A_concept · R^γ / (N·P + t_concept)^δ2
                       + A_data / (D + t_data)^α

N total parameters, D training tokens seen, R compression ratio (tokens per concept, ≥ 1), P the share
of parameters in the concept backbone (in [0, 1]), E0 the irreducible loss. Eleven parameters; all but γ
are positive and are optimised as logarithms, so a fit can never leave that domain.

Decay law, eq. 23 (the fractional loss drop of the WSD decay window, by log-linear regression)::

    Δ_decay = k · L_stable^a · R^b · N^c,      Δ_decay = (L_stable − L_decayed) / L_stable

L_stable is the loss when the decay starts (90% of the run's tokens in the paper) and L_decayed the
loss at the end of the window (99%).

CSV inputs (a header row; other columns, e.g. a run name, are ignored):

- main law: ``N, D, R, P, loss`` — one row per logged point of every training trajectory.
- decay law, summary form: ``N, R, loss_stable, loss_decayed`` — one row per run.
- decay law, trajectory form: ``run, N, R, D, loss`` — every logged point; the window's ends are read off
  each run's curve at `window[0]` and `window[1]` of its largest D (linear interpolation in D).

Fitting eq. 22 is a non-convex least-squares problem (on the loss, unweighted): the loss is linear in
(E0, A_token, A_concept, A_data) once the other seven parameters are fixed. Random starts of those seven
are screened with a closed-form solve for the linear four; the best few are refined by Levenberg–Marquardt
on the seven with the four solved out at every step (variable projection), each refined start is
polished on all eleven, and the lowest final cost wins (the result depends on the data and the seed
only). Everything is float64 with analytic Jacobians; the seven stay in a wide box (exponents in
[1e-3, 5], |γ| ≤ 5, offsets within nine decades of the data's N or D). N and D are divided by their
geometric means inside the fit to keep the problem well conditioned; reported parameters are in the
CSV's units.

Degenerate input is refused (ValueError): a loss (or Δ) that takes one value, a column whose exponent
needs two values taking one, no more rows than parameters. A fit that ran but should not be trusted
carries `warnings` (`fit_warnings`): R² below `MIN_GOOD_R2`, or parameters stopped at the box's edge.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

MAIN_COLUMNS = ("N", "D", "R", "P", "loss")
DECAY_COLUMNS = ("N", "R", "loss_stable", "loss_decayed")
DECAY_TRAJECTORY_COLUMNS = ("run", "N", "R", "D", "loss")
MAIN_PARAMETERS = (
    "E0",
    "A_token",
    "t_token",
    "delta_1",
    "A_concept",
    "gamma",
    "t_concept",
    "delta_2",
    "A_data",
    "t_data",
    "alpha",
)
DECAY_PARAMETERS = ("k", "a", "b", "c")
# Inputs a prediction needs, per law.
PREDICT_INPUTS = {"main": ("N", "D", "R", "P"), "decay": ("N", "R", "loss_stable")}
# Below this R² the fitted law does not describe the runs (either law; the decay law's is on log Δ).
MIN_GOOD_R2 = 0.9

Column = torch.Tensor | float


# The paper's symbols, which are also the CSV's column names, rather than lower-case words.
def main_law_loss(params: Mapping[str, float], N: Column, D: Column, R: Column, P: Column) -> torch.Tensor:  # noqa: N803
    """Eq. 22 evaluated elementwise (float64); `params` holds the names in `MAIN_PARAMETERS`."""
    N, D, R, P = (torch.as_tensor(value, dtype=torch.float64) for value in (N, D, R, P))
    token_term = params["A_token"] / (N * (1 - P) + params["t_token"]) ** params["delta_1"]
    concept_term = (
        params["A_concept"] * R ** params["gamma"] / (N * P + params["t_concept"]) ** params["delta_2"]
    )
    data_term = params["A_data"] / (D + params["t_data"]) ** params["alpha"]
    return params["E0"] + token_term + concept_term + data_term


def decay_law_delta(params: Mapping[str, float], loss_stable: Column, R: Column, N: Column) -> torch.Tensor:  # noqa: N803
    """Eq. 23 evaluated elementwise (float64): the fractional loss drop of the decay window."""
    loss_stable, R, N = (torch.as_tensor(value, dtype=torch.float64) for value in (loss_stable, R, N))
    return params["k"] * loss_stable ** params["a"] * R ** params["b"] * N ** params["c"]


@dataclass
class ScalingLawFit:
    """A fitted law: its parameters (CSV units), R² on the fitted quantity, and the row count."""

    law: str
    params: dict[str, float]
    r2: float
    rows: int
    # Decay law only: R² of Δ itself (the regression's own R², `r2`, is on log Δ as in the paper).
    extra: dict[str, float] = field(default_factory=dict)
    # Why the fit should not be trusted (`fit_warnings`); empty for a good fit.
    warnings: list[str] = field(default_factory=list)

    def predict(self, **config: float) -> float:
        """Loss (main law) or Δ_decay (decay law) for one configuration given by keyword, e.g. N=1e9."""
        needed = PREDICT_INPUTS[self.law]
        missing = [name for name in needed if name not in config]
        unknown = sorted(set(config) - set(needed))
        if missing or unknown:
            raise ValueError(
                f"{self.law} law prediction needs {', '.join(needed)}; missing {missing}, unknown {unknown}"
            )
        values = {name: float(config[name]) for name in needed}
        _check_values(values, where=f"{self.law} law prediction")
        if self.law == "main":
            return float(main_law_loss(self.params, values["N"], values["D"], values["R"], values["P"]))
        return float(decay_law_delta(self.params, values["loss_stable"], values["R"], values["N"]))


LAW_FILE_FORMAT = "hf_concept.scaling_law/1"


def save_fit(fit: ScalingLawFit, path: str | Path, source: str | None = None) -> Path:
    """Write `fit` as a JSON law file (what `hf-concept plan --law` reads), atomically: a temporary file
    beside it, then renamed, so a reader never sees half a file."""
    path = Path(path)
    record = {"format": LAW_FILE_FORMAT, "law": fit.law, "params": fit.params, "r2": fit.r2, "rows": fit.rows}
    record.update(extra=fit.extra, warnings=fit.warnings, source=source)
    staging = path.with_name(f".{path.name}.tmp")
    try:
        staging.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        staging.replace(path)
    finally:
        staging.unlink(missing_ok=True)
    return path


def load_fit(path: str | Path, law: str = "main") -> ScalingLawFit:
    """A law file written by `save_fit` (`fit-scaling --save`) or printed by `fit-scaling --json`; raises
    ValueError naming the file and what is wrong with it (missing, not JSON, another law, a parameter
    missing or not a finite number)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"law file {str(path)!r} does not exist")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"law file {str(path)!r} is not JSON ({error})") from None
    if not isinstance(record, dict) or record.get("law") != law:
        found = record.get("law") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"law file {str(path)!r} holds law={found!r}; the {law} law (eq. 22) is needed")
    params = record.get("params")
    names = MAIN_PARAMETERS if law == "main" else DECAY_PARAMETERS
    for name in names:
        value = params.get(name) if isinstance(params, dict) else None
        if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)):
            raise ValueError(
                f"law file {str(path)!r}: parameter {name!r} must be a finite number, got {value!r}"
            )
    return ScalingLawFit(
        law=law,
        params={name: float(params[name]) for name in names},
        r2=float(record.get("r2", float("nan"))),
        rows=int(record.get("rows", 0)),
        extra=dict(record.get("extra") or {}),
        warnings=[str(text) for text in record.get("warnings") or []],
    )


def _check_values(values: Mapping[str, float], where: str) -> None:
    """Domain rules shared by CSV rows and predictions; raises naming the column, place and value."""
    for name, value in values.items():
        if name == "run":
            continue
        if not math.isfinite(value):
            raise ValueError(f"{where}: column {name!r} must be a finite number, got {value!r}")
        if name in ("N", "D", "loss", "loss_stable", "loss_decayed") and value <= 0:
            raise ValueError(f"{where}: column {name!r} must be > 0, got {value!r}")
        if name == "R" and value < 1:
            raise ValueError(f"{where}: column 'R' (compression ratio) must be >= 1, got {value!r}")
        if name == "P" and not 0 <= value <= 1:
            raise ValueError(f"{where}: column 'P' (concept share) must be in [0, 1], got {value!r}")


def read_runs(path: str | Path, columns: Sequence[str]) -> dict[str, list]:
    """Read `columns` of a CSV file into lists (floats; `run` stays text), validating every row."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = [name.strip() for name in reader.fieldnames or []]
        missing = [name for name in columns if name not in header]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; header is {header}")
        reader.fieldnames = header
        table: dict[str, list] = {name: [] for name in columns}
        # Line 1 is the header, so the first data row is line 2.
        for line, row in enumerate(reader, start=2):
            values = {name: _cell(row.get(name), name, f"{path}: line {line}") for name in columns}
            _check_values(values, where=f"{path}: line {line}")
            for name in columns:
                table[name].append(values[name])
    return table


def _cell(text: str | None, name: str, where: str) -> float | str:
    text = (text or "").strip()
    if not text:
        raise ValueError(f"{where}: column {name!r} is empty")
    if name == "run":
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{where}: column {name!r} is not a number: {text!r}") from None


def _as_columns(runs: Mapping[str, Sequence], columns: Sequence[str], law: str) -> dict[str, torch.Tensor]:
    """Validate in-memory runs (as `read_runs` returns them) and turn them into float64 tensors."""
    missing = [name for name in columns if name not in runs]
    if missing:
        raise ValueError(f"{law} law: missing column(s) {', '.join(missing)}")
    lengths = {name: len(runs[name]) for name in columns}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{law} law: columns have different lengths {lengths}")
    for index in range(next(iter(lengths.values()))):
        _check_values({name: float(runs[name][index]) for name in columns}, where=f"{law} law: row {index}")
    return {name: torch.tensor([float(v) for v in runs[name]], dtype=torch.float64) for name in columns}


def _require_rows(rows: int, parameters: int, law: str) -> None:
    # One more row than parameters, so that R² is not trivially 1.
    if rows <= parameters:
        raise ValueError(
            f"{law} law: {rows} rows is too few to fit {parameters} parameters (need > {parameters})"
        )


def _require_varying_target(target: torch.Tensor, name: str, law: str) -> None:
    # A constant target (up to rounding) has no variance to explain: R² is undefined or noise.
    if float(target.max() - target.min()) <= 1e-9 * float(target.abs().max()):
        raise ValueError(
            f"{law} law: {name} takes one value only ({float(target[0]):.6g} on every row), so there is "
            "nothing to fit; give runs whose loss changes with N, D or R"
        )


def _require_spread(columns: Mapping[str, torch.Tensor], names: Sequence[str], law: str) -> None:
    for name in names:
        if torch.unique(columns[name]).numel() < 2:
            raise ValueError(
                f"{law} law: column {name!r} takes one value only; its exponent cannot be fitted"
            )


def r_squared(observed: torch.Tensor, predicted: torch.Tensor) -> float:
    """Coefficient of determination 1 − SS_res / SS_tot."""
    residual = ((observed - predicted) ** 2).sum()
    total = ((observed - observed.mean()) ** 2).sum()
    return float(1 - residual / total) if total > 0 else float("nan")


def fit_decay_law(runs: Mapping[str, Sequence]) -> ScalingLawFit:
    """Fit eq. 23 by ordinary least squares on log Δ = log k + a·log L_stable + b·log R + c·log N."""
    columns = _as_columns(runs, DECAY_COLUMNS, "decay")
    rows = columns["N"].numel()
    _require_rows(rows, len(DECAY_PARAMETERS), "decay")
    _require_spread(columns, ("N", "R", "loss_stable"), "decay")
    delta = (columns["loss_stable"] - columns["loss_decayed"]) / columns["loss_stable"]
    if (delta <= 0).any():
        row = int(torch.nonzero(delta <= 0)[0])
        raise ValueError(f"decay law: row {row}: loss_decayed must be below loss_stable for a log fit")
    _require_varying_target(delta, "delta_decay = (loss_stable - loss_decayed) / loss_stable", "decay")
    features = torch.stack([columns[name].log() for name in ("loss_stable", "R", "N")], dim=1)  # (rows, 3)
    target = delta.log()  # (rows,)
    # Centred regression: the intercept is recovered afterwards, which keeps the system well conditioned.
    feature_mean, target_mean = features.mean(0), target.mean()
    slopes = torch.linalg.lstsq(features - feature_mean, (target - target_mean).unsqueeze(1)).solution[:, 0]
    intercept = target_mean - feature_mean @ slopes
    params = {
        "k": float(intercept.exp()),
        "a": float(slopes[0]),
        "b": float(slopes[1]),
        "c": float(slopes[2]),
    }
    fitted_delta = decay_law_delta(params, columns["loss_stable"], columns["R"], columns["N"])
    r2 = r_squared(target, fitted_delta.log())
    return ScalingLawFit(
        law="decay",
        params=params,
        r2=r2,
        rows=rows,
        extra={"r2_delta": r_squared(delta, fitted_delta)},
        warnings=fit_warnings(r2),
    )


def decay_runs_from_trajectories(
    runs: Mapping[str, Sequence], window: tuple[float, float] = (0.90, 0.99)
) -> dict[str, list]:
    """Reduce trajectory rows (run, N, R, D, loss) to one decay row per run (N, R, loss_stable, loss_decayed).

    Each run's losses at `window[0]`·D_max and `window[1]`·D_max are linearly interpolated in D; the run
    must have logged points on both sides of each (D_max, its largest D, is one of them).
    """
    start, end = window
    if not 0 < start < end <= 1:
        raise ValueError(f"decay window must satisfy 0 < start < end <= 1, got {window}")
    summary: dict[str, list] = {name: [] for name in DECAY_COLUMNS}
    for run in dict.fromkeys(runs["run"]):
        indices = [i for i, name in enumerate(runs["run"]) if name == run]
        for name in ("N", "R"):
            if len({float(runs[name][i]) for i in indices}) != 1:
                raise ValueError(f"decay law: run {run!r}: column {name!r} changes within the run")
        points = sorted((float(runs["D"][i]), float(runs["loss"][i])) for i in indices)
        tokens = torch.tensor([d for d, _ in points], dtype=torch.float64)
        losses = torch.tensor([loss for _, loss in points], dtype=torch.float64)
        ends = [_interpolate(tokens, losses, fraction * tokens[-1], run) for fraction in (start, end)]
        summary["N"].append(float(runs["N"][indices[0]]))
        summary["R"].append(float(runs["R"][indices[0]]))
        summary["loss_stable"].append(ends[0])
        summary["loss_decayed"].append(ends[1])
    return summary


def _interpolate(tokens: torch.Tensor, losses: torch.Tensor, at: torch.Tensor, run: str) -> float:
    above = int(torch.searchsorted(tokens, at))
    if above == 0 and tokens[0] > at:
        raise ValueError(f"decay law: run {run!r} has no logged point at or before D={float(at):.6g}")
    if tokens[min(above, len(tokens) - 1)] == at:
        return float(losses[min(above, len(tokens) - 1)])
    weight = (at - tokens[above - 1]) / (tokens[above] - tokens[above - 1])
    return float(losses[above - 1] + weight * (losses[above] - losses[above - 1]))


def fit_main_law(
    runs: Mapping[str, Sequence], restarts: int = 256, refine: int = 8, seed: int = 0
) -> ScalingLawFit:
    """Fit eq. 22 by least squares on the loss: screen `restarts` random starts, refine the best `refine`."""
    columns = _as_columns(runs, MAIN_COLUMNS, "main")
    rows = columns["N"].numel()
    _require_rows(rows, len(MAIN_PARAMETERS), "main")
    _require_spread(columns, ("N", "D", "R"), "main")
    _require_varying_target(columns["loss"], "column 'loss'", "main")
    if restarts < 1 or refine < 1:
        raise ValueError(f"main law: restarts and refine must be >= 1, got {restarts} and {refine}")
    n_scale = float(columns["N"].log().mean().exp())
    d_scale = float(columns["D"].log().mean().exp())
    scaled = dict(columns, N=columns["N"] / n_scale, D=columns["D"] / d_scale)
    # The problem is a few hundred rows by eleven parameters: one thread is fastest, and a thread pool
    # contending with other work on a small machine made each step 10-50x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        theta = _fit_main_theta(scaled, restarts, refine, seed)
    finally:
        torch.set_num_threads(threads)
    params = _to_csv_units(theta, n_scale, d_scale)
    fitted = main_law_loss(params, columns["N"], columns["D"], columns["R"], columns["P"])
    r2 = r_squared(columns["loss"], fitted)
    return ScalingLawFit(
        law="main", params=params, r2=r2, rows=rows, warnings=fit_warnings(r2, _at_search_edge(theta))
    )


def fit_warnings(r2: float, pinned: Sequence[str] = ()) -> list[str]:
    """Why a fit should not be trusted: R² below `MIN_GOOD_R2`, parameters pinned at the search box."""
    found = []
    if not r2 >= MIN_GOOD_R2:
        found.append(f"R^2 = {r2:.4g} is below {MIN_GOOD_R2}: the law does not describe these runs")
    if pinned:
        found.append(
            f"{', '.join(pinned)} ended at the edge of the search box, where the fit stopped rather than "
            "converged"
        )
    return found


def _at_search_edge(theta: torch.Tensor) -> list[str]:
    """Nonlinear parameters of θ at an edge of `_SEARCH_BOX`. An offset at its lower edge is fine: the
    term is a pure power law. Anything else there (an exponent of 5 or 1e-3, |γ| = 5, an offset of nine
    decades) means the search ran into the box."""
    low, high = _SEARCH_BOX
    pinned = []
    for position, index in enumerate(_NONLINEAR_INDEX):
        name, value = MAIN_PARAMETERS[index], float(theta[index])
        at_low = value <= float(low[position]) + 1e-6
        at_high = value >= float(high[position]) - 1e-6
        if at_high or (at_low and not name.startswith("t_")):
            pinned.append(name)
    return pinned


def _fit_main_theta(
    scaled: Mapping[str, torch.Tensor], restarts: int, refine: int, seed: int
) -> torch.Tensor:
    starts = _screen_starts(scaled, restarts, refine, torch.Generator().manual_seed(seed))
    # Stage 1 (variable projection): only the seven nonlinear parameters move, the linear four are
    # re-solved at every step, which removes the A–δ valleys that slow a joint search.
    projected = [
        _levenberg_marquardt(lambda nl: _projected_residuals(nl, scaled), nl, bounds=_SEARCH_BOX)
        for nl in starts
    ]
    # Stage 2: all eleven in log space, which keeps E0 and the A's positive. Every refined start is
    # polished and the lowest final cost wins: the lowest stage-1 cost can need a negative E0 or A,
    # which the clamp below turns into a poor start (an R² of 0.2 with exponents pinned at the box).
    low = torch.full((len(MAIN_PARAMETERS),), -math.inf, dtype=torch.float64)
    high = torch.full_like(low, math.inf)
    low[list(_NONLINEAR_INDEX)], high[list(_NONLINEAR_INDEX)] = _SEARCH_BOX
    polished = []
    for nonlinear, _ in projected:
        linear = _solve_linear(_basis(nonlinear, scaled)[0], scaled["loss"]).clamp_min(1e-8)
        theta = torch.empty_like(low)
        theta[list(_LINEAR_INDEX)], theta[list(_NONLINEAR_INDEX)] = linear.log(), nonlinear
        polished.append(
            _levenberg_marquardt(lambda full: _full_residuals(full, scaled), theta, bounds=(low, high))
        )
    # Costs that differ by rounding alone (BLAS results vary in the last bits from call to call) are
    # ties, won by the best-screened start: otherwise noise picks among equally good but different
    # parameters (a flat valley of the law) and one file and seed give a different fit each time.
    best = min(cost for _, cost in polished)
    tie = best + _TIE_TOLERANCE * float((scaled["loss"] - scaled["loss"].mean()).square().sum())
    return next(theta for theta, cost in polished if cost <= tie)


# Final costs closer than this fraction of the loss's total sum of squares are the same fit (R² equal to
# nine digits).
_TIE_TOLERANCE = 1e-9


# θ (length 11, order MAIN_PARAMETERS) holds the log of every positive parameter and γ as it is.
# E0 and the three A's multiply the basis columns of `_basis`; the other seven shape those columns.
_LINEAR_INDEX = (0, 1, 4, 8)
_NONLINEAR_INDEX = (2, 3, 5, 6, 7, 9, 10)
# The basis column each nonlinear parameter shapes: t_token, δ1 -> 1; γ, t_concept, δ2 -> 2; t_data, α -> 3.
_NONLINEAR_COLUMN = (1, 1, 2, 2, 2, 3, 3)


def _box(offset: tuple[float, float], exponent: tuple[float, float], gamma: tuple[float, float]):
    """(low, high) tensors over the nonlinear entries of θ, from ranges of the offsets (in units of the
    data's geometric-mean N or D), of δ1, δ2, α, and of γ."""
    log_offset, log_exponent = tuple(map(math.log, offset)), tuple(map(math.log, exponent))
    columns = [log_offset, log_exponent, gamma, log_offset, log_exponent, log_offset, log_exponent]
    return tuple(torch.tensor(ends, dtype=torch.float64) for ends in zip(*columns, strict=True))


# Random starts: offsets within three decades of the data's scale, exponents in (0.05, 1.5), γ in (−0.5, 1).
_START_BOX = _box(offset=(1e-3, 1e3), exponent=(0.05, 1.5), gamma=(-0.5, 1.0))
# The search never leaves this wider box; its edges keep a column from collapsing onto the constant
# (an exponent of 0) or from overflowing, either of which made the least-squares problem degenerate.
_SEARCH_BOX = _box(offset=(1e-9, 1e9), exponent=(1e-3, 5.0), gamma=(-5.0, 5.0))


def _basis(nonlinear: torch.Tensor, scaled: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 22's four columns with unit coefficients, and each column's derivative by its own parameter.

    `nonlinear` is (..., 7) in `_NONLINEAR_INDEX` order; returns (..., rows, 4) and (..., rows, 7).
    """
    log_t_token, log_delta_1, gamma, log_t_concept, log_delta_2, log_t_data, log_alpha = (
        value.unsqueeze(-1) for value in nonlinear.unbind(-1)
    )
    N, D, R, P = (scaled[name] for name in ("N", "D", "R", "P"))
    token_base = N * (1 - P) + log_t_token.exp()  # (..., rows)
    concept_base = N * P + log_t_concept.exp()
    data_base = D + log_t_data.exp()
    token = token_base ** -log_delta_1.exp()
    concept = R**gamma * concept_base ** -log_delta_2.exp()
    data = data_base ** -log_alpha.exp()
    basis = torch.stack([torch.ones_like(token), token, concept, data], dim=-1)  # (..., rows, 4)
    # Derivatives by log t, log δ, γ (chain rule: d/d(log x) = x·d/dx).
    derivatives = torch.stack(
        [
            -token * log_delta_1.exp() * log_t_token.exp() / token_base,
            -token * token_base.log() * log_delta_1.exp(),
            concept * R.log(),
            -concept * log_delta_2.exp() * log_t_concept.exp() / concept_base,
            -concept * concept_base.log() * log_delta_2.exp(),
            -data * log_alpha.exp() * log_t_data.exp() / data_base,
            -data * data_base.log() * log_alpha.exp(),
        ],
        dim=-1,
    )  # (..., rows, 7)
    return basis, derivatives


def _solve_linear(basis: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """Least-squares coefficients (E0, A_token, A_concept, A_data) for fixed basis columns: (..., 4)."""
    target = loss.expand(basis.shape[:-1]).unsqueeze(-1)  # (..., rows, 1)
    # gelsd (SVD) copes with a column that collapsed, and gives the same bits on every call: the default
    # gelsy does not (its last bits vary from call to call), which made one seed give different fits.
    return torch.linalg.lstsq(basis, target, driver="gelsd").solution[..., 0]


def _projected_residuals(
    nonlinear: torch.Tensor, scaled: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable projection: residuals with the linear coefficients solved out, and Kaufman's Jacobian."""
    basis, derivatives = _basis(nonlinear, scaled)
    linear = _solve_linear(basis, scaled["loss"])
    residual = basis @ linear - scaled["loss"]  # (rows,)
    jacobian = derivatives * linear[list(_NONLINEAR_COLUMN)]  # (rows, 7)
    orthonormal, _ = torch.linalg.qr(basis)  # (rows, 4)
    return residual, jacobian - orthonormal @ (orthonormal.T @ jacobian)


def _full_residuals(
    theta: torch.Tensor, scaled: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residuals of eq. 22 and their Jacobian by all eleven entries of θ (analytic, float64)."""
    basis, derivatives = _basis(theta[list(_NONLINEAR_INDEX)], scaled)
    linear = theta[list(_LINEAR_INDEX)].exp()
    residual = basis @ linear - scaled["loss"]  # (rows,)
    jacobian = torch.empty(residual.shape[0], len(MAIN_PARAMETERS), dtype=torch.float64)
    jacobian[:, list(_LINEAR_INDEX)] = basis * linear
    jacobian[:, list(_NONLINEAR_INDEX)] = derivatives * linear[list(_NONLINEAR_COLUMN)]
    return residual, jacobian


def _to_csv_units(theta: torch.Tensor, n_scale: float, d_scale: float) -> dict[str, float]:
    """Undo the N/n_scale, D/d_scale substitution: A/(N/s + t)^δ = (A·s^δ)/(N + t·s)^δ."""
    values = {
        name: float(value if name == "gamma" else value.exp())
        for name, value in zip(MAIN_PARAMETERS, theta.unbind(), strict=True)
    }
    values["A_token"] *= n_scale ** values["delta_1"]
    values["A_concept"] *= n_scale ** values["delta_2"]
    values["A_data"] *= d_scale ** values["alpha"]
    values["t_token"] *= n_scale
    values["t_concept"] *= n_scale
    values["t_data"] *= d_scale
    return values


def _screen_starts(
    scaled: Mapping[str, torch.Tensor], restarts: int, keep: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """Random nonlinear parameters (exponents, γ, offsets), scored with their best linear coefficients."""
    low, high = _START_BOX
    nonlinear = low + (high - low) * torch.rand(restarts, 7, generator=generator, dtype=torch.float64)
    basis, _ = _basis(nonlinear, scaled)  # (restarts, rows, 4)
    linear = _solve_linear(basis, scaled["loss"])  # (restarts, 4)
    cost = ((basis @ linear.unsqueeze(-1)).squeeze(-1) - scaled["loss"]).square().sum(-1)
    cost = torch.where(torch.isfinite(cost), cost, torch.full_like(cost, math.inf))
    return list(nonlinear[cost.argsort()[:keep]])


def _levenberg_marquardt(
    residuals: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    theta: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor],
    max_steps: int = 500,
) -> tuple[torch.Tensor, float]:
    """Minimise ‖r(θ)‖² from θ within `bounds`, `residuals` giving (r, ∂r/∂θ); returns θ and its cost.

    Marquardt's scaling (damping proportional to diag JᵀJ), Nielsen's damping update, and steps clipped
    to the box. Only finite, strictly lower costs are accepted, so a start that hits NaN stays where it was.
    """
    current, J = residuals(theta)  # (rows,), (rows, params)
    cost = float(current @ current)
    if not math.isfinite(cost):
        return theta, math.inf
    damping, growth = 1e-3, 2.0
    for _ in range(max_steps):
        gradient, curvature = J.T @ current, J.T @ J
        scale = torch.diag(curvature.diagonal().clamp_min(1e-12))
        step = torch.linalg.solve(curvature + damping * scale, -gradient)
        step = torch.minimum(torch.maximum(theta + step, bounds[0]), bounds[1]) - theta
        trial, trial_J = residuals(theta + step)
        trial_cost = float(trial @ trial)
        # Gain ratio: the decrease achieved over the decrease the local quadratic model promised.
        promised = float(step @ (damping * scale @ step - gradient))
        if not (math.isfinite(trial_cost) and trial_cost < cost and promised > 0):
            damping, growth = damping * growth, growth * 2
            if damping > 1e16:
                break
            continue
        gain = (cost - trial_cost) / promised
        converged = cost - trial_cost <= 1e-12 * cost or float(step.abs().max()) < 1e-10
        theta, current, J, cost = theta + step, trial, trial_J, trial_cost
        damping, growth = damping * max(1 / 3, 1 - (2 * min(gain, 1.0) - 1) ** 3), 2.0
        if converged:
            break
    return theta, cost


def fit_scaling_csv(
    path: str | Path, law: str = "main", window: tuple[float, float] = (0.90, 0.99), **fit_options: int
) -> ScalingLawFit:
    """Read a CSV of runs (see the module docstring for its columns) and fit the chosen law."""
    if law == "main":
        return fit_main_law(read_runs(path, MAIN_COLUMNS), **fit_options)
    if law != "decay":
        raise ValueError(f"law must be 'main' or 'decay', got {law!r}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    with path.open(newline="") as handle:
        header = {name.strip() for name in next(csv.reader(handle), [])}
    # The summary form names loss_stable; the trajectory form has a run column and per-point losses.
    if "loss_stable" in header or "run" not in header:
        return fit_decay_law(read_runs(path, DECAY_COLUMNS))
    trajectories = read_runs(path, DECAY_TRAJECTORY_COLUMNS)
    return fit_decay_law(decay_runs_from_trajectories(trajectories, window))
