"""The figures (`nqfjax.plots` and the demo's): rendered from small inputs and
checked for what a reader relies on: every axis labelled, every legend entry
distinct, guide lines through the data they claim to fit (or labelled as offset,
and offset by what they say), ratio and residual panels showing the ratio they
claim, and no pyplot state touched."""

import subprocess
import sys
from types import SimpleNamespace

import matplotlib


matplotlib.use("Agg")

import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

import nqfjax  # noqa: E402
from nqfjax import plots  # noqa: E402
from nqfjax.experiments import _report, demo  # noqa: E402


# ---------------------------------------------------------------------------
# what every figure must satisfy


def _axes(fig):
    """The plotting axes (not colour bars)."""
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.axison]


def _check_labels(fig):
    """A y label on every axes, and an x label on every axes or on one that
    shares its x axis (a stacked panel below it)."""
    for ax in _axes(fig):
        assert ax.get_ylabel().strip(), ax.get_title()
        siblings = ax.get_shared_x_axes().get_siblings(ax)
        assert any(a.get_xlabel().strip() for a in siblings), ax.get_title()


def _check_legends(fig):
    legends = [ax.get_legend() for ax in fig.axes] + list(fig.legends)
    legends = [leg for leg in legends if leg is not None]
    for leg in legends:
        texts = [t.get_text() for t in leg.get_texts()]
        assert all(t.strip() for t in texts), texts
        assert len(set(texts)) == len(texts), f"repeated legend entries: {texts}"
    return legends


def _line(ax, gid):
    found = [line for line in ax.get_lines() if line.get_gid() == gid]
    assert len(found) == 1, (gid, [line.get_gid() for line in ax.get_lines()])
    return found[0]


def _at(x, data_line):
    """The data line at `x`, interpolated in log-log (the axes here are log)."""
    xd, yd = (np.asarray(a, float) for a in data_line.get_data())
    keep = (xd > 0) & (yd > 0)
    return np.exp(np.interp(np.log(x), np.log(xd[keep]), np.log(yd[keep])))


def _check_guides(fig, rtol):
    """Lines with gid `guide:NAME` pass through the line `data:NAME` within
    `rtol` (relative, in log); `offset:NAME:F` lines say "offset" in their label
    and sit F times above the data at the middle of their range. On axes with
    data, a line labelled as a fit must be one of these. Returns how many guides
    were checked."""
    checked = 0
    for ax in _axes(fig):
        has_data = any((ln.get_gid() or "").startswith("data:") for ln in ax.lines)
        for line in ax.get_lines():
            gid, label = line.get_gid() or "", line.get_label()
            if has_data and "fit" in label.lower() and not label.startswith("_"):
                assert gid.startswith(("guide:", "offset:")), label
            if gid.startswith("guide:"):
                data = _line(ax, "data:" + gid.split(":", 1)[1])
                x, y = (np.asarray(a, float) for a in line.get_data())
                ratio = y / _at(x, data)
                assert np.max(np.abs(np.log(ratio))) < rtol, (label, ratio)
                checked += 1
            elif gid.startswith("offset:"):
                _, name, factor = gid.split(":")
                assert "offset" in label, label
                x, y = (np.asarray(a, float) for a in line.get_data())
                mid = len(x) // 2
                xm = np.sqrt(x[0] * x[-1])
                ym = np.exp(np.interp(np.log(xm), np.log(x), np.log(y)))
                measured = ym / _at(xm, _line(ax, "data:" + name))
                np.testing.assert_allclose(measured, float(factor), rtol=rtol)
                assert x[mid] > 0
                checked += 1
    return checked


def _overlap(a, b, px=0.5):
    """Whether two display boxes share more than a sliver of `px` pixels."""
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width > px and height > px


def _check_layout(fig):
    """Every axes (its tick labels, axis labels, title and legend) and the
    figure's own texts lie inside the figure, and no two of them overlap: the
    demo's figures place their axes by fixed margins, not by a layout engine."""
    renderer = fig.canvas.get_renderer()
    page = fig.bbox.padded(1)  # one pixel of rounding
    boxes = [
        (ax.get_title() or ax.get_label(), ax.get_tightbbox(renderer))
        for ax in fig.axes
    ]
    boxes += [(t.get_text(), t.get_window_extent(renderer)) for t in fig.texts]
    for name, box in boxes:
        assert page.x0 <= box.x0 and box.x1 <= page.x1, (name, box, page)
        assert page.y0 <= box.y0 and box.y1 <= page.y1, (name, box, page)
    for i, (name, box) in enumerate(boxes):
        for other, box2 in boxes[:i]:
            assert not _overlap(box, box2), (name, other, box, box2)


_UNSUPER = str.maketrans(
    "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079", "-0123456789"
)


def _decade_labels(axis):
    """The visible major tick labels of a log axis written as a power of ten
    with a Unicode exponent (`10⁻⁵`): checks that each says its tick's value,
    and returns how many there were."""
    lo, hi = sorted(axis.get_view_interval())
    n = 0
    for tick in axis.get_major_ticks():
        text, x = tick.label1.get_text(), tick.get_loc()
        if not (tick.label1.get_visible() and text and lo <= x <= hi):
            continue
        if text.startswith("$"):  # matplotlib's own mathtext label
            continue
        assert text.startswith("10"), text
        exponent = int(text[2:].translate(_UNSUPER))
        assert x == pytest.approx(10.0**exponent, rel=1e-9), (text, x)
        n += 1
    return n


def _check(fig, rtol=1e-3):
    FigureCanvasAgg(fig).draw()  # renders: a broken artist fails here
    _check_layout(fig)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":
                _decade_labels(axis)
    _check_labels(fig)
    _check_legends(fig)
    return _check_guides(fig, rtol)


# ---------------------------------------------------------------------------
# small inputs


def _logistic_loss(t, r, eps, levels):
    """A loss that drops by `levels[k]` when mode k (rate r[k]) switches on."""
    m = 1 / (1 + (1 / eps - 1) * np.exp(-np.outer(t, r)))
    return levels[-1] + (1 - m) @ np.asarray(levels[:-1])


def _engines_like():
    t = np.linspace(0, 3000, 200)
    r = np.array([0.02, 0.01])
    L = _logistic_loss(t, r, 1e-6, [1.0, 0.5, 1e-3])
    L_w = L * (1 + 0.01 * np.sin(t / 300))  # W-space: 1% off
    L_m = L * (1 + 1e-4)
    tau = np.linspace(0, 1.3, 80)
    stair = np.where(tau < 0.5, 1.501, np.where(tau < 1.0, 0.501, 1e-3))
    rescaled = {
        rf"LV, $\varepsilon$ = {e:.0e}": (tau, stair * (1 + 0.1 * k))
        for k, e in enumerate((1e-6, 1e-12))
    }
    return SimpleNamespace(
        record=t,
        L_w=L_w,
        L_m=L_m,
        L_lv=L,
        t_pred=np.log(1e6) / r,
        log_eps=np.log(1e6),
        tau_grid=tau,
        stair_loss=stair,
        rescaled=rescaled,
    )


def _sweep_like():
    x = np.log(1 / np.array([1e-4, 1e-6, 1e-8]))
    predicted = np.outer(x, [100.0, 200.0]) + 50
    return SimpleNamespace(
        log_inv_sigma=x,
        times=predicted * np.array([[1.002], [0.998], [1.001]]),
        predicted=predicted,
        slopes=np.array([99.0, 201.0]),
        predicted_slopes=np.array([100.0, 200.0]),
    )


def _power_law_like(gamma=0.7):
    t = np.geomspace(1, 1e6, 300)
    loss = 1.0 / (1 + t) ** gamma + 1e-4
    window = (1e2, 1e5)
    ft = np.geomspace(*window, 40)
    return {
        "ts": t,
        "loss": loss,
        "sharp": loss * (1 + 0.02 * np.sin(np.log(t) * 5)),
        "window": window,
        "fit_curve": (ft, 1.0 / (1 + ft) ** gamma + 1e-4),
        "gamma_fit": gamma,
        "gamma_rich": 2 / 3,
        "gamma_lazy": 1.0,
    }


def _structures_like():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(5, 5))
    B = rng.normal(size=(4, 4))
    return (
        {"first": A + A.T, "second": 0.01 * (B + B.T)},
        {"first": [("a", 2), ("u", 3)], "second": [("q", 2), ("k", 2)]},
    )


@pytest.fixture(scope="module")
def demo_figures(tmp_path_factory):
    """The demo's four figures, through the demo's own figure code, from small
    synthetic stage results (and written to files)."""
    out = tmp_path_factory.mktemp("figures")
    cfg = demo.DemoConfig.quick()
    figs = demo._figures(
        out, cfg, _engines_like(), _sweep_like(), _power_law_like(), _structures_like()
    )
    return out, figs


# ---------------------------------------------------------------------------
# the demo's figures


def test_demo_writes_its_four_figures(demo_figures):
    out, figs = demo_figures
    assert tuple(figs) == _report.FIGURES
    for name in figs:
        assert (out / name).stat().st_size > 10_000, name


def test_staircase_figure(demo_figures):
    fig = demo_figures[1]["staircase.png"]
    _check(fig)
    ax, ratio, stair = _axes(fig)
    eng = _engines_like()
    # the ratio panel is the ratio it claims, where the reference is on the plot
    line = ratio.get_lines()[0]
    assert line.get_label().endswith("/ Lotka-Volterra")
    x, y = line.get_data()
    expected = np.interp(x, eng.record, eng.L_w / eng.L_lv)
    np.testing.assert_allclose(y, expected, rtol=1e-12)
    # every engine is on the top panel under its own name
    labels = {line.get_label() for line in ax.get_lines()}
    assert {"M-space flow", "Lotka-Volterra"} <= labels
    # the rescaled axis ends shortly after the last step (tau = 1.0), not far past
    assert 1.0 < stair.get_xlim()[1] <= 1.2
    # epsilon is related to sigma in the panel's title
    assert "sigma" in stair.get_title() and "varepsilon" in stair.get_title()
    # the log axes' decades are labelled (10⁻⁵, ...), each with its own value
    for axis in (ax.yaxis, ratio.xaxis, stair.yaxis):
        assert _decade_labels(axis) >= 2


def test_init_scale_figure(demo_figures):
    fig = demo_figures[1]["init_scale.png"]
    _check(fig)
    ax, ratio = _axes(fig)
    sw = _sweep_like()
    for k, line in enumerate(ratio.get_lines()[:2]):
        np.testing.assert_allclose(
            line.get_ydata(), sw.times[:, k] / sw.predicted[:, k], rtol=1e-12
        )
    # the theory lines are the predicted times themselves (nothing fitted)
    theory = [line for line in ax.get_lines() if "theory" in line.get_label()]
    assert len(theory) == 2
    np.testing.assert_allclose(theory[1].get_ydata(), sw.predicted[:, 1])


def test_power_law_figure(demo_figures):
    fig = demo_figures[1]["power_law.png"]
    # the fitted curve passes through the data (here the same function), the
    # two theory slopes are offset x3 and say so
    assert _check(fig) == 3
    ax, slope = _axes(fig)
    rich = [line for line in ax.get_lines() if "rich" in line.get_label()]
    fit = [line for line in ax.get_lines() if line.get_label().startswith("fit")]
    assert len(rich) == len(fit) == 1
    # the rich line is not under the fit: at the window's middle it is 3x above
    xm = np.sqrt(1e2 * 1e5)
    assert _at(xm, rich[0]) > 2.5 * _at(xm, fit[0])
    # the local exponent of L = (1 + t)^-0.7 + 1e-4 is 0.7 t / (1 + t) while the
    # floor is negligible: at t = 1e3 (floor 1e-4 vs 8e-3 of the curve) ~0.69
    t, g = slope.get_lines()[0].get_data()
    gi = np.interp(1e3, t, g)
    assert 0.66 < gi < 0.70, gi
    # the log axes' decades are labelled (10⁻⁵, ...), each with its own value
    assert _decade_labels(ax.yaxis) >= 2 and _decade_labels(slope.xaxis) >= 2


def test_structures_figure(demo_figures):
    fig = demo_figures[1]["structures.png"]
    _check(fig)
    images = [im for ax in _axes(fig) for im in ax.get_images()]
    assert len(images) == 2
    for im in images:
        # one shared scale: each map divided by its largest |entry|
        assert im.get_clim() == (-1, 1)
        assert np.max(np.abs(im.get_array())) == pytest.approx(1.0)
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and "max" in bars[0].get_ylabel()
    first = _axes(fig)[0]
    assert [t.get_text() for t in first.get_xticklabels()] == ["a", "u"]
    assert [t.get_text() for t in first.get_yticklabels()] == ["a", "u"]
    assert "max |A|" in first.get_title()
    with pytest.raises(ValueError, match="blocks"):
        plots.plot_structures({"first": np.eye(3)}, blocks={"first": [("a", 2)]})


def test_demo_figures_make_room_for_other_data():
    """The margins follow the data: six-digit switch-on times, one panel only,
    maps without blocks (a tick per index) on two rows, a loss within a decade
    (matplotlib's mathtext labels on minor ticks) all fit, nothing overlapping."""
    sw = _sweep_like()
    fig = plots.plot_init_scale(sw.log_inv_sigma, 300 * sw.times, sw.predicted_slopes)
    _check(fig)
    eng = _engines_like()
    fig = plots.plot_loss_curves(
        {"W": (eng.record, eng.L_w), "LV": (eng.record, eng.L_lv)},
        switch_times=eng.t_pred,
    )
    _check(fig)
    assert len(_axes(fig)) == 2
    t = np.linspace(1, 100, 50)
    loss = 0.5 + 0.1 * np.exp(-t / 30)
    fig = plots.plot_loss_curves({"a": (t, loss), "b": (t, 1.01 * loss)}, floor=0.7)
    _check(fig)
    rng = np.random.default_rng(1)
    maps = {f"m{i}": rng.normal(size=(p, p)) for i, p in enumerate([3, 12, 5, 4])}
    _check(plots.plot_structures(maps))


def test_real_structure_matrices_have_their_blocks():
    """The demo's block layouts add up to each real architecture's p."""
    matrices, blocks = demo._structure_matrices(0)
    assert set(matrices) == set(blocks)
    for name, A in matrices.items():
        assert sum(size for _, size in blocks[name]) == A.shape[0], name
    fig = plots.plot_structures(matrices, blocks=blocks)
    _check(fig)


# ---------------------------------------------------------------------------
# the sweep's and the fit's figures


def test_sweep_figure_distinguishes_seeds_and_shows_step_zero():
    steps = np.array([0, 1, 2, 5, 10, 20, 50, 100])
    R = steps.size
    base = 1.0 / (1 + steps)
    loss = np.empty((1, 1, 2, 2, 2, R))
    for s, lr, seed in np.ndindex(2, 2, 2):
        loss[0, 0, s, lr, seed] = base * (1 + 0.1 * s + 0.01 * lr + 0.001 * seed)
    loss[0, 0, 1, 1, 1, 5:] = np.nan  # one run diverged
    grid = dict(
        optimizer=["gd"],
        architecture=["perceptron"],
        init_scale=[1e-3, 1e-1],
        learning_rate=[0.05, 0.5],
        seed=[0, 7],
    )
    fig = plots.plot_sweep(steps, loss, grid)
    _check(fig)
    (legend,) = _check_legends(fig)
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == [
        "σ = 0.001", "σ = 0.1", "η = 0.05", "η = 0.5", "seed 0", "seed 7", "diverged",
    ]  # fmt: skip
    (ax,) = _axes(fig)
    # step 0 is drawn at 0 on a symlog axis, not moved to 0.5
    assert ax.get_xscale() == "symlog"
    curves = [line for line in ax.get_lines() if line.get_marker() != "x"]
    assert len(curves) == 8 and all(line.get_xdata()[0] == 0 for line in curves)
    # the two seeds of one (sigma, eta) differ in marker, not only in the data
    markers = {line.get_marker() for line in curves}
    assert len(markers) == 2
    # the diverged run is marked at its last finite step
    (cross,) = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert cross.get_xdata()[0] == steps[4]


def _ticks(ax):
    """The predicted switch-on ticks of a sweep panel, `gid -> line`."""
    return {
        line.get_gid(): line
        for line in ax.get_lines()
        if str(line.get_gid()).startswith("switch_on:")
    }


def test_sweep_figure_marks_predicted_switch_on():
    steps = np.array([0, 1, 10, 100, 1000])
    loss = np.ones((2, 1, 2, 1, 1, steps.size))
    grid = dict(
        optimizer=["gd", "adam"],
        architecture=["perceptron"],
        init_scale=[1e-4, 1e-2],
        learning_rate=[0.1],
        seed=[0],
    )
    switch_on = np.full((2, 1, 2, 1, 2), np.nan)  # no theory for Adam
    switch_on[0, 0, :, 0] = [[300.0, 700.0], [150.0, np.nan]]
    fig = plots.plot_sweep(steps, loss, grid, switch_on=switch_on)
    _check(fig)
    (legend,) = _check_legends(fig)
    assert "predicted switch-on\n(theory, first seed)" in [
        t.get_text() for t in legend.get_texts()
    ]
    gd, adam = _axes(fig)
    ticks = _ticks(gd)
    assert sorted(ticks) == ["switch_on:0:0:0", "switch_on:0:0:1", "switch_on:1:0:0"]
    for gid, line in ticks.items():
        s, lr, k = map(int, gid.split(":")[1:])
        # a vertical line at the time given, in the colour of its init scale
        assert set(line.get_xdata()) == {switch_on[0, 0, s, lr, k]}
        assert line.get_color() == gd.get_lines()[s].get_color()
    assert _ticks(adam) == {}
    # without predictions there is no tick and no legend entry for them
    plain = plots.plot_sweep(steps, loss, grid)
    (legend,) = _check_legends(plain)
    assert not any("switch-on" in t.get_text() for t in legend.get_texts())


@pytest.mark.slow
def test_sweep_marks_sit_where_the_theory_and_the_data_put_them(tmp_path, monkeypatch):
    """`nqfjax sweep` on a quadratic network (exactly the quadratic form) trained
    by GD from small init: the ticks are `predict`'s switch-on times, and each
    first tick falls inside the measured first drop."""
    from nqfjax.experiments import sweep_config as sc, sweep_run

    config = sc.parse_sweep_config(
        {
            "data": {"n_samples": 32, "teacher_units": 1, "seed": 3},
            "train": {
                "num_steps": 3000,
                "width": 4,
                "num_records": 60,
                "precision": "float64",
            },
            "grid": {
                "init_scale": [1e-5, 1e-3],
                "learning_rate": [0.01],
                "seed": [0],
                "optimizer": ["gd", "adam"],
                "architecture": ["quadratic"],
            },
            "architectures": {"quadratic": {"d": 3}},
        }  # fmt: skip
    )
    figures = []
    plot = plots.plot_sweep
    monkeypatch.setattr(
        sweep_run.plots,
        "plot_sweep",
        lambda *a, **k: figures.append(plot(*a, **k)) or figures[-1],
    )
    result = sweep_run.run_sweep_config(config, tmp_path, progress=False)
    (fig,) = figures
    (legend,) = _check_legends(fig)
    assert "predicted switch-on\n(theory, first seed)" in [
        t.get_text() for t in legend.get_texts()
    ]
    gd, adam = _axes(fig)
    assert _ticks(adam) == {}
    ticks = _ticks(gd)
    data = np.load(tmp_path / "results.npz")
    steps, loss = data["steps"], data["loss"]
    structure = config.structure("quadratic")
    with jax.enable_x64(True):
        xs, ys = sweep_run._make_data(config, structure, np.float64)
        for s, sigma in enumerate(config.grid["init_scale"]):
            pred = nqfjax.predict(
                structure, xs, ys, init_scale=sigma, learning_rate=0.01, width=4,
                key=jax.random.key(0), ts=steps,
            )  # fmt: skip
            times = np.asarray(pred.switch_times)
            assert times.size >= 1
            for k, t in enumerate(times):
                # the same computation: equal to float64 roundoff
                x = _ticks(gd)[f"switch_on:{s}:0:{k}"].get_xdata()[0]
                np.testing.assert_allclose(x, t, rtol=1e-12)
            # the data: the first drop (from 90% to 10% of the way from the
            # initial loss to the last) contains the first tick; a tick off by a
            # factor 1.3 in time (a wrong clock) would miss it, as it lasts
            # ~ln(81) / r against t ~ ln(m*/m0) / r >= 20 / r
            curve = loss[0, 0, s, 0, 0]
            level = curve[-1] + np.array([0.9, 0.1]) * (curve[0] - curve[-1])
            start, end = (steps[np.argmax(curve < v)] for v in level)
            assert start <= times[0] <= end, (start, times[0], end)
    times = result.predicted_switch_on[0, 0]  # gd, quadratic
    assert len(ticks) == np.isfinite(times).sum()
    assert np.isnan(result.predicted_switch_on[1]).all()  # adam: no theory
    # the result's old reading as the summary dict: deprecated, the same numbers
    with pytest.warns(DeprecationWarning, match="SweepOutput"):
        old = result["predicted_switch_on"]["gd-quadratic"]["times"]
    np.testing.assert_array_equal(
        np.asarray(old, float), times[..., : np.shape(old)[-1]]
    )
    assert (result.n_computed, result.n_loaded, result.damaged) == (2, 0, ())


def test_curve_analysis_figure_has_residuals():
    t = np.r_[0.0, np.geomspace(1, 1e5, 200)]
    loss = 2.0 * (1 + t) ** -0.6
    tt = np.geomspace(10, 1e4, 50)
    curves = {
        "plateaus": SimpleNamespace(
            start=[1.0], end=[5.0], level=[1.9], drop_times=[6.0]
        ),
        "power_law_curve": (tt, 2.0 * (1 + tt) ** -0.6),
        "spectrum_curve": loss * 1.01,
    }
    summary = {
        "power_law": {"window": [10, 1e4], "gamma": 0.6},
        "spectrum": {"alpha": 1.0, "beta": 0.5},
    }
    fig = plots.plot_curve_analysis(t, loss, curves, summary)
    # the power law passes through the data; the spectrum model within 1%
    assert _check(fig, rtol=0.011) == 2
    ax, resid = _axes(fig)
    power, spectrum = resid.get_lines()[:2]
    # the residuals are ln(data / model)
    assert np.max(np.abs(power.get_ydata())) < 1e-3
    np.testing.assert_allclose(spectrum.get_ydata(), -np.log(1.01), rtol=1e-9)


# ---------------------------------------------------------------------------
# the report and pyplot


def test_report_explains_itself():
    """Every figure has a "what to notice" line, the glossary defines what the
    report prints, and each comparison row says what it compares."""
    cfg = demo.DemoConfig.quick()
    row = {
        "what": "plateau losses: real network (W-space) vs Lotka-Volterra simulation",
        "compares": "simulation vs simulation",
        "measured": [1.0],
        "predicted": [1.0],
        "max_rel_error": 0.0,
        "tolerance": 0.01,
        "passed": True,
    }
    report = {
        "created": "now",
        "versions": {"nqfjax": "0", "jax": "0", "backend": "cpu"},
        "config": {"k": cfg.k, "init_scale": cfg.init_scale},
        "headline": {
            "gamma_fit": 0.68,
            "gamma_fit_err": 1e-4,
            "gamma_rich": 2 / 3,
            "gamma_lazy": 1.0,
        },
        "checks": [row],
        "figures": list(_report.FIGURES),
    }
    text = _report.markdown(report)
    for name in _report.FIGURES:
        section = text.split(f"### {name}")[1].split("###")[0]
        assert "**What to notice:**" in section, name
    glossary = text.split("## Glossary")[1]
    for word in ("sigma", "epsilon", "r_k", "alpha, beta", "gamma", "rich / lazy",
                 "W-space", "M-space", "sharp-switch", "tau"):  # fmt: skip
        assert f"**{word}" in glossary, word
    assert "| simulation vs simulation |" in text
    assert "prediction vs measurement" not in text
    # the staircase caption names the engines drawn: without the M-space flow
    # (`--quick`) it says so instead of describing a curve that is not there
    staircase = text.split("### staircase.png")[1].split("###")[0]
    assert "the M-space flow and" in staircase and "three curves" in staircase
    report["config"]["mflow_solver"] = None  # as `DemoConfig.quick()` writes it
    staircase = _report.markdown(report).split("### staircase.png")[1].split("###")[0]
    assert "the M-space flow and" not in staircase
    assert "leaves the M-space flow out" in staircase and "two curves" in staircase


def test_figures_leave_pyplot_alone():
    """A notebook's open figures survive a call into the library, which builds
    its figures without pyplot."""
    mine = plt.figure()
    before = plt.get_fignums()
    eng = _engines_like()
    plots.plot_loss_curves({"a": (eng.record, eng.L_w), "b": (eng.record, eng.L_lv)})
    plots.plot_structures(*_structures_like()[:1])
    assert plt.get_fignums() == before and plt.fignum_exists(mine.number)
    plt.close(mine)
    # and importing the library, its demo and the CLI does not load pyplot
    code = (
        "import sys, nqfjax, nqfjax.plots, nqfjax.cli, nqfjax.experiments.demo; "
        "print('matplotlib.pyplot' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
