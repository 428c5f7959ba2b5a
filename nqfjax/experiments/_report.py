"""The demo's checks and report: `report.json` (every number) and `report.md`
(the comparisons, the figures with what to notice in each, and a glossary of the
words and symbols the report prints)."""

import dataclasses
import datetime

import equinox as eqx
import numpy as np

from ..io import versions


#: The demo's figures, in the report's order.
FIGURES = ("staircase.png", "init_scale.png", "power_law.png", "structures.png")

GLOSSARY = (
    (
        "W-space",
        "training the real network's weights W (p x m, one unit per "
        "column) by gradient descent: `nqfjax.train`.",
    ),
    (
        "M-space flow",
        "the closed gradient flow of M = W W^T that the quadratic "
        "form implies: `nqfjax.solve_mflow`.",
    ),
    (
        "Lotka-Volterra (LV)",
        "the reduction of the M-space flow to the mode "
        "amplitudes m_k when the data share an eigenbasis: dm_k/dt = m_k (r_k - "
        "sum_l B_kl m_l); `nqfjax.lv_reduce`, `nqfjax.solve_lv`.",
    ),
    (
        "mode, m_k",
        "one direction u_k of the eigenbasis and its amplitude "
        "m_k = u_k^T M u_k; m*_k is its learned value.",
    ),
    (
        "r_k",
        "the growth rate of mode k per gradient step while it is small "
        "(here 2 x learning rate x the teacher's singular value).",
    ),
    ("B", "the interactions between modes: how much a learned mode slows the others."),
    (
        "sigma",
        "the init scale: the initial weights are sigma times a standard normal matrix.",
    ),
    (
        "epsilon",
        "the typical initial amplitude of a mode, m_k(0) ~ sigma^2 m "
        "(m the width): the theory's small parameter.",
    ),
    (
        "switch-on time t_k",
        "when mode k is half learned (m_k = m*_k / 2); "
        "predicted by `nqfjax.switch_on_times`, about ln(1/epsilon) / r_k.",
    ),
    ("plateau", "a stretch where the loss stays flat between two switch-ons."),
    (
        "tau",
        "rescaled time t / ln(1/epsilon), in which the switch-on times stay "
        "finite as epsilon -> 0.",
    ),
    (
        "singular limit, staircase",
        "the loss in rescaled time as epsilon -> 0: "
        "flat plateaus joined by sudden drops (`nqfjax.singular_limit`).",
    ),
    (
        "alpha, beta",
        "the exponents of a power-law task: mode k's eigenvalue "
        "lambda_k falls like k^-alpha and its learned value m*_k like k^-beta.",
    ),
    ("gamma", "the exponent of the loss's power law L ~ t^-gamma."),
    (
        "rich / lazy",
        "two predictions of gamma: rich (this theory, small init: "
        "modes switch on suddenly one after another), gamma = (alpha + 2 beta - 1) "
        "/ (alpha + beta); lazy (a linear model with the same spectra, each mode "
        "relaxing at a rate ~ lambda_k), gamma = (alpha + 2 beta - 1) / alpha.",
    ),
    (
        "sharp-switch sum",
        "the loss if every mode switched on instantly at its "
        'switch-on time; "refined" keeps the logarithmic corrections to those '
        "times (`nqfjax.sharp_switch_loss`).",
    ),
    (
        "structure matrix A(x)",
        "the matrix of the layer's quadratic form: "
        "f(x; W) - f(x; 0) = Tr[W W^T A(x)] to leading order.",
    ),
)

CAPTIONS = {
    "staircase.png": (
        "Left: the real network (W-space), the M-space flow and the Lotka-Volterra "
        "reduction from the same start, with the predicted switch-on times, and "
        "below their ratio to the LV curve. Right: LV curves in rescaled time at "
        "shrinking epsilon beside the singular-limit staircase.",
        "the three curves lie on top of each other (ratios within a few percent "
        "of 1, away from the drops where a small shift in time is a large "
        "change in loss); each drop is centred on its grey line (the predicted "
        "switch-on time, when the mode is half learned); on the right, the "
        "smaller epsilon, the closer the curve is to the staircase.",
    ),
    "init_scale.png": (
        "Switch-on times of the real network at several init scales (points) and "
        "the theory's switch-on times at the same scales (lines), with the ratio "
        "below.",
        "straight lines in ln(1/sigma) with slopes 2/r_k: ten times smaller "
        "weights delay each mode by a fixed number of steps, more for slower "
        "modes; the ratio stays near 1.",
    ),
    "power_law.png": (
        "Many independent modes: the LV loss curve, the refined sharp-switch sum "
        "and the power law fitted in the shaded window (through the data); the "
        "rich and lazy slopes are guides drawn above the data (offset, as "
        "labelled). Below: the local exponent -d ln L / d ln t.",
        "inside the window the local exponent is flat at the fitted gamma, a "
        "few percent above the rich value because of logarithmic corrections "
        "that the refined sharp-switch sum reproduces; the lazy exponent is far "
        "off.",
    ),
    "structures.png": (
        "The structure matrix A_0(x) of each architecture at one random input, "
        "divided by its largest entry (in the title), with a unit's parameter "
        "blocks named on the axes.",
        "the matrices are sparse and block-structured: a perceptron couples its "
        "readout to its input weights only, attention couples query to key, a "
        "mixture of experts leaves its router block empty at this order.",
    ),
}


class DemoCheck(eqx.Module):
    """One comparison of the demo: a measured value against a prediction of the
    theory or another simulation.

    **Fields:** `name`; `what` (in words); `compares` (`"... vs theory"` or
    `"simulation vs simulation"`); `measured`, `predicted` (the reference,
    named so in `report.json`), tuples of floats of one length;
    `max_rel_error`, the largest `|measured / predicted - 1|`; `tolerance`;
    `passed`, whether `max_rel_error <= tolerance`."""

    name: str = eqx.field(static=True)
    what: str = eqx.field(static=True)
    compares: str = eqx.field(static=True)
    measured: tuple[float, ...] = eqx.field(static=True)
    predicted: tuple[float, ...] = eqx.field(static=True)
    max_rel_error: float = eqx.field(static=True)
    tolerance: float = eqx.field(static=True)
    passed: bool = eqx.field(static=True)

    def as_dict(self) -> dict:
        """The check as `report.json` holds it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            **out,
            "measured": list(self.measured),
            "predicted": list(self.predicted),
        }


def _check(name, measured, reference, tol, what, compares) -> DemoCheck:
    measured = np.atleast_1d(np.asarray(measured, float))
    reference = np.atleast_1d(np.asarray(reference, float))
    rel = np.abs(measured / reference - 1)
    worst = float(np.max(rel)) if rel.size else float("nan")
    return DemoCheck(
        name=name,
        what=what,
        compares=compares,
        measured=tuple(measured.tolist()),
        # the value compared against: a prediction, or another simulation (see
        # `compares`); named "predicted" in report.json for compatibility
        predicted=tuple(reference.tolist()),
        max_rel_error=worst,
        tolerance=tol,
        passed=bool(np.isfinite(worst) and worst <= tol),
    )


def checks(cfg, eng, sw, pl) -> list[DemoCheck]:
    """The demo's comparisons, each measured against a prediction of the theory
    or another simulation (`compares` says which)."""
    return [
        _check(
            "switch_on_times",
            eng.t_meas,
            eng.t_pred,
            cfg.tol_switch_on,
            "switch-on times (steps): real network vs theory (switch_on_times)",
            "simulation vs theory",
        ),
        _check(
            "plateau_losses",
            eng.L_w[eng.plateau_idx],
            eng.L_lv[eng.plateau_idx],
            cfg.tol_plateau,
            "plateau losses: real network (W-space) vs Lotka-Volterra simulation",
            "simulation vs simulation",
        ),
        _check(
            "init_scale_slopes",
            sw.slopes,
            sw.predicted_slopes,
            cfg.tol_slope,
            "d t_k / d ln(1/sigma): real-network sweep vs theory 2/r_k",
            "simulation vs theory",
        ),
        _check(
            "gamma_vs_sharp_switch",
            pl["gamma_fit"],
            pl["gamma_sharp"],
            cfg.tol_gamma_sharp,
            "power-law exponent gamma: fit to the LV curve vs fit to the refined "
            "sharp-switch sum",
            "simulation vs theory",
        ),
        _check(
            "gamma_vs_rich",
            pl["gamma_fit"],
            pl["gamma_rich"],
            cfg.tol_gamma_rich,
            "power-law exponent gamma: fit to the LV curve vs rich-regime theory "
            "(alpha+2beta-1)/(alpha+beta)",
            "simulation vs theory",
        ),
    ]


def report_dict(cfg, pb, timings, checks, eng, sw, pl, matrices, figures) -> dict:
    """The content of `report.json`."""
    lv, stair = pb.lv, eng.stair
    return {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": cfg.as_dict(),
        "versions": versions(),
        "timings_s": timings,
        "passed": all(c.passed for c in checks),
        "checks": [c.as_dict() for c in checks],
        "headline": {
            "switch_on_measured": eng.t_meas.tolist(),
            "switch_on_predicted": eng.t_pred.tolist(),
            "slopes_measured": sw.slopes.tolist(),
            "slopes_predicted": sw.predicted_slopes.tolist(),
            "gamma_fit": pl["gamma_fit"],
            "gamma_fit_err": pl["gamma_fit_err"],
            "gamma_sharp": pl["gamma_sharp"],
            "gamma_rich": pl["gamma_rich"],
            "gamma_lazy": pl["gamma_lazy"],
        },
        "lotka_volterra": {
            "r": np.asarray(lv.r).tolist(),
            "B": np.asarray(lv.interactions.as_matrix()).tolist(),
            "learned_modes": pb.learn.tolist(),
            "m0": eng.m0.tolist(),
            "log_inv_eps": eng.log_eps,
        },
        "curves": {
            "t": eng.record.tolist(),
            "loss_w_space": eng.L_w.tolist(),
            "loss_m_space": None if eng.L_m is None else eng.L_m.tolist(),
            "loss_lv": eng.L_lv.tolist(),
            "plateau_indices": eng.plateau_idx,
        },
        "staircase": {
            "jump_times": np.asarray(stair.jump_times).tolist(),
            "plateau_losses": np.asarray(stair.plateau_losses).tolist(),
            "tau": eng.tau_grid.tolist(),
            "rescaled_lv": {k: v[1].tolist() for k, v in eng.rescaled.items()},
            "events": [e._asdict() for e in stair.events],
        },
        "init_scale_sweep": {
            "init_scales": list(cfg.sweep_scales),
            "log_inv_sigma": sw.log_inv_sigma.tolist(),
            "switch_on_times": sw.times.tolist(),
            "switch_on_times_predicted": sw.predicted.tolist(),
        },
        "power_law": {
            "t": pl["ts"].tolist(),
            "loss": pl["loss"].tolist(),
            "sharp_switch": pl["sharp"].tolist(),
            "window": list(pl["window"]),
        },
        "structures": {name: A.tolist() for name, A in matrices.items()},
        "figures": figures,
    }


def _fmt(values) -> str:
    return ", ".join(f"{x:.4g}" for x in values)


def markdown(report: dict) -> str:
    """`report.md` from the report dict of `run_demo`."""
    h, cfg = report["headline"], report["config"]
    lines = [
        "# nqfjax demo report",
        "",
        f"Generated {report['created']} with nqfjax {report['versions']['nqfjax']} "
        f"(jax {report['versions']['jax']}, backend {report['versions']['backend']}).",
        "",
        f"A two-layer tanh perceptron with {cfg['k']} outputs learns a linear "
        f"teacher from init scale sigma = {cfg['init_scale']:g}: each singular "
        "value of the teacher is one mode that switches on suddenly after a "
        "plateau. The words and symbols are explained in the glossary at the end.",
        "",
        "## Comparisons",
        "",
        "Each row compares a measurement with a reference: a prediction of the "
        "theory, or another simulation where two engines are compared.",
        "",
        "| comparison | kind | reference | measured | max rel. error | tolerance "
        "| ok |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report["checks"]:
        lines.append(
            f"| {c['what']} | {c.get('compares', '')} | {_fmt(c['predicted'])} | "
            f"{_fmt(c['measured'])} | {c['max_rel_error']:.2%} | "
            f"{c['tolerance']:.0%} | {'yes' if c['passed'] else '**NO**'} |"
        )
    lines += [
        "",
        f"Power-law exponent: fitted {h['gamma_fit']:.4f} +- "
        f"{h['gamma_fit_err']:.1g} (the fit's own error bar, which knows nothing "
        f"of the model's corrections), rich theory {h['gamma_rich']:.4f} (lazy "
        f"{h['gamma_lazy']:.4f}); the fit sits a few percent above the asymptotic "
        "rich value because of the logarithmic corrections that the refined "
        "sharp-switch sum keeps.",
        "",
        "## Figures",
        "",
    ]
    for name in report["figures"]:
        caption, notice = CAPTIONS[name]
        # the M-space flow left out: its solver `null` (`None`)
        no_mflow = report["config"].get("mflow_solver", "") is None
        if name == "staircase.png" and no_mflow:
            caption = caption.replace(
                "(W-space), the M-space flow and", "(W-space) and"
            ) + (
                " (`--quick` leaves the M-space flow out: the full `nqfjax demo` "
                "draws it between the two.)"
            )
            notice = notice.replace("the three curves", "the two curves")
        lines += [
            f"### {name}",
            "",
            caption,
            "",
            f"![{name}]({name})",
            "",
            f"**What to notice:** {notice}",
            "",
        ]
    lines += ["## Glossary", ""]
    lines += [f"- **{word}**: {meaning}" for word, meaning in GLOSSARY]
    return "\n".join(lines) + "\n"
