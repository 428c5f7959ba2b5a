"""Calibration of `detect_plateaus` and `select_model` across the sharpness
and shape of the drops (issue 29), on seeded staircases with known truth
(`staircase_families.py`): each drop at least 0.3 in `ln L`, each plateau at
least 0.3 decades, 0-10% multiplicative noise.

The method was developed on the DEVELOPMENT cells and measured on the
HELD_OUT ones only at the end: on first measurement 37/40 plateau counts
right (92.5%; asymmetric drops 12/15, the others 25/25), drop times within
0.41 widths; after one change made on the development cells (a drop's span
from 20% to 80% of its fall in `ln L`, was 10%-90%) and the test's exclusion
of marginal records, 36/39 (92%). The issue's 95% was then met on the
development cells, not on the held-out ones.

Second round (2026-12-04): the held-out misses looked at (levels read off
the modes' asymptotes, misplaced by a mode's long tail), a new hold-out
(`NEW_HELD_OUT`, other drop shapes, correlated noise, mixed logs) written
before any change and measured once at the end. The plateaus are now read
off the fitted curve (`analysis/stair_reading.py`) and the noise is measured
about a first fit with its correlation: development 17/17, first hold-out
39/39, new hold-out 29/29 on its one measurement (docs/how-to/loss-curve.md).

Third step (2026-12-04): a "cannot tell" note where the fit of one drop
more has a plateau across a drop (`read_plateaus`), looked at on the two
cannot-tell cases that came back short without a note and checked for
false notes on the development and first held-out curves; the new
hold-out measured once more, nothing tuned on it. False notes on these
resolvable curves: development 0/17, first hold-out 3/39 (1 the new
note), new hold-out 8/29 (0 the new note)."""

import numpy as np
import pytest
import staircase_families as sf

import nqfjax


#: (family, sampling, spikes): developed on.
DEVELOPMENT = (
    ("logistic_t", "log", 0.0),
    ("logistic_t", "linear", 0.0),
    ("sigmoid_logt", "log", 0.0),
    ("sigmoid_logt", "linear", 0.0),
)
#: Never looked at while developing: asymmetric drops, every-step records,
#: heavy-tailed spikes on 2% of the records.
HELD_OUT = (
    ("asymmetric", "log", 0.0),
    ("asymmetric", "linear", 0.0),
    ("asymmetric", "every_step", 0.0),
    ("logistic_t", "every_step", 0.0),
    ("sigmoid_logt", "every_step", 0.0),
    ("logistic_t", "log", 0.02),
    ("sigmoid_logt", "linear", 0.02),
    ("asymmetric", "log", 0.02),
)
#: Held out from the second round of work (written before it, measured once
#: at its end): drop shapes from other generators (`sf.NEW_FAMILIES`),
#: AR(1)-correlated noise (the 4th entry, `rho`) and geometric-then-linear
#: logs.
NEW_HELD_OUT = (
    ("gompertz", "log", 0.0, 0.0),
    ("gompertz", "every_step", 0.0, 0.95),
    ("gompertz", "mixed", 0.02, 0.0),
    ("tanh_sqrt", "mixed", 0.0, 0.9),
    ("tanh_sqrt", "linear", 0.02, 0.0),
    ("tanh_sqrt", "every_step", 0.0, 0.0),
)


def _cases(cells, n, seed):
    """Seeded curves, `n` drawn per cell: `(cell, ts, loss, truth)`, the
    truth's count being the plateaus the record sees (`seen_plateaus`);
    those whose records make the count marginal (a plateau with 2-5 records)
    are left out (measured: 0-2 per cell of 5, linear sampling only)."""
    rng = np.random.default_rng(seed)
    for cell in cells:
        family, sampling, spikes, *rho = cell
        for _ in range(n):
            curve, t_end, truth = sf.staircase(family, rng)
            noise = rng.uniform(0, 0.1)
            ts, loss = sf.sample(
                rng, curve, t_end, sampling, noise, spikes, truth["t_first"], *rho
            )
            seen, clear = sf.seen_plateaus(ts, truth)
            if clear:  # (marginal records: counted by `_marginal`)
                yield cell, ts, loss, dict(truth, seen=seen, noise=noise)


def _measure(cells, n, seed):
    """Per cell: plateau counts right, and each correctly counted drop's
    offset from the truth in units of its 10%-90% width (decades); and how
    many curves (each resolvable: drops >= 0.3 in `ln L`, plateaus >= 0.3
    decades) were given a "cannot tell" note (`ambiguous`), false by
    construction, by kind: `fit`, a fit of one drop more with a plateau
    across a drop (the last added), `other`, the earlier notes."""
    right, total, offsets, notes = {}, {}, [], {"fit": 0, "other": 0}
    for cell, ts, loss, truth in _cases(cells, n, seed):
        found = nqfjax.detect_plateaus(ts, loss)
        ok = len(found) == truth["seen"]
        right[cell] = right.get(cell, 0) + ok
        total[cell] = total.get(cell, 0) + 1
        said = found.ambiguous.split("; ") if found.ambiguous else []
        notes["fit"] += any(note.startswith("a fit of") for note in said)
        notes["other"] += any(not note.startswith("a fit of") for note in said)
        if said:
            print(cell, "note:", found.ambiguous)
        if ok and truth["seen"] == truth["K"] + 1:
            off = np.abs(np.log10(np.asarray(found.drop_times) / truth["mid"]))
            offsets.append(off / truth["width"])
    for cell in right:
        print(cell, f"{right[cell]}/{total[cell]}")
    print("false cannot-tell notes:", notes, "of", sum(total.values()))
    offsets = np.concatenate(offsets)
    return sum(right.values()), sum(total.values()), offsets, notes


@pytest.mark.slow  # 20 staircase fits
def test_development_families():
    """Plateau counts right on >= 95% (the issue's bar) and drop times within
    half a transition width (the issue's bar) on >= 95% of the drops.
    Measured: 17/17 (3 marginal records left out), offsets at most 0.13
    widths. No "cannot tell" note on these resolvable curves (measured
    2026-12-04: none of 17; at most 1 allowed, for round-off in the fits)."""
    right, total, offsets, notes = _measure(DEVELOPMENT, 5, seed=10)
    print(f"development: {right}/{total}; offsets max {offsets.max():.2f}")
    assert right >= 0.95 * total
    assert sum(notes.values()) <= 1, notes
    assert np.mean(offsets < 0.5) >= 0.95, np.sort(offsets)[-5:]


@pytest.mark.slow  # 40 staircase fits
def test_held_out_families():
    """The held-out cells: counts right on >= 95% (the issue's bar; measured
    36/39 in the first round, 39/39 since the plateaus are read off the
    fitted curve, which the misses were looked at for: no longer a clean
    hold-out, see `test_new_held_out_families`); drop times within half a
    width on >= 95% of the drops (measured: all, at most 0.12 widths).
    "Cannot tell" notes on these resolvable curves, false by construction:
    measured 2026-12-04 on 3 of 39, 1 from a fit of one drop more (an
    asymmetric drop under 7% noise and spikes, split by a fit 15 worse in
    BIC) and 2 earlier ones; bounded at 10%."""
    right, total, offsets, notes = _measure(HELD_OUT, 5, seed=20)
    print(f"held out: {right}/{total}; offsets max {offsets.max():.2f}")
    assert right >= 0.95 * total
    assert sum(notes.values()) <= 0.1 * total, notes
    assert np.mean(offsets < 0.5) >= 0.95, np.sort(offsets)[-5:]


@pytest.mark.slow  # 30 staircase fits and model selections
def test_new_held_out_families():
    """The second hold-out (`NEW_HELD_OUT`): plateau counts right and
    `select_model` right (a staircase of as many drops as the record sees)
    on >= 95% (the issue's bars), drop times within half a width on >= 95%
    of the drops. Measured once, at the end of the second round: counts
    29/29 (one marginal record left out), `select_model` 28/29 (one
    spiked Gompertz staircase of 2 drops given 3), drop times within half a
    width on 81/83 drops (the others 0.53 and 0.65 widths). Measured once
    more on 2026-12-04 after the note on a fit of one drop more was added
    (nothing tuned on these): the same, and "cannot tell" notes on these
    resolvable curves, false by construction, on 8 of 29, none of them
    the new note (5 another count within 10 of BIC, 2 a first drop on 1-2
    records, 2 several modes in a drop, 1 a stretch that does not level
    off; two curves have two)."""
    right, total, offsets, notes = _measure(NEW_HELD_OUT, 5, seed=50)
    chosen_right = 0
    for cell, ts, loss, truth in _cases(NEW_HELD_OUT, 5, seed=50):
        chosen = nqfjax.select_model(ts, loss)
        ok = chosen.best == "staircase" and chosen.n_modes == truth["seen"] - 1
        chosen_right += ok
        if not ok:
            print(cell, chosen.best, chosen.n_modes, truth["seen"] - 1)
    print(
        f"new held out: {right}/{total}; select_model {chosen_right}/{total}; "
        f"offsets max {offsets.max():.2f}"
    )
    assert right >= 0.95 * total
    assert chosen_right >= 0.95 * total
    assert np.mean(offsets < 0.5) >= 0.95, np.sort(offsets)[-5:]
    assert notes["fit"] <= 1 and notes["other"] <= 10, notes


@pytest.mark.slow  # 12 staircase fits
def test_cannot_tell_is_said():
    """Two drops overlapping (the second 10% done 0.2 decades before the
    first is 90% done), or drops of 0.11-0.2 in `ln L` (just above
    `min_drop`) under 5-10% noise:
    never more plateaus than there are; short counts mostly come with
    `ambiguous` saying why (see the bound below): a drop fitted by several
    modes without a plateau between them, a stretch between drops that does
    not level off, another count within 10 of BIC, a drop within the noise,
    a fit of one drop more with a plateau across a drop."""
    rng = np.random.default_rng(30)
    silent = 0
    for i in range(12):
        family = sf.FAMILIES[i % 3]
        if i < 6:
            curve, t_end, truth = sf.staircase(family, rng, K=2, gap=-0.2)
            noise = rng.uniform(0, 0.05)
        else:
            curve, t_end, truth = sf.staircase(family, rng, K=2, drops=(0.11, 0.2))
            noise = rng.uniform(0.05, 0.1)
        ts, loss = sf.sample(rng, curve, t_end, "log", noise, 0.0, truth["t_first"])
        found = nqfjax.detect_plateaus(ts, loss)
        assert len(found) <= truth["K"] + 1, (i, found)
        if len(found) < truth["K"] + 1 and not found.ambiguous:
            silent += 1
    # measured 2026-12-04: 1 of 12 short without a word (2 before the note
    # on a fit of one drop more with a plateau across a drop, which the
    # drops of 0.12 and 0.17 under 7% noise now get; 4 before the notes on
    # several modes in one drop and on stretches that do not level off, 6
    # before those on a drop wider than a decade and one half done outside
    # the data). The one left: two overlapping logistic drops (0.38 and
    # 0.83 in ln L, 1.6% noise) that one logistic mode (p = 2.6) fits as
    # well as the truth does (chi-square 76.5 against 74.7 on 160 bins):
    # the fit of two modes puts its second on the first's shoulder, as it
    # does on 40% of the resolvable curves. This bounds them (one case of
    # margin for round-off in the fits on other platforms)
    print(f"cannot tell: {silent} of 12 short without a word")
    assert silent <= 2


@pytest.mark.slow  # 6 model selections
def test_select_model_across_families():
    """`select_model` calls staircases of every family staircases with their
    number of drops (before: 0 of 12 on the issue's gentle staircases).
    Measured: 6/6."""
    right = 0
    for cell, ts, loss, truth in _cases(
        [("logistic_t", "log", 0), ("sigmoid_logt", "linear", 0)]
        + [("asymmetric", "log", 0)],
        2,
        seed=40,
    ):
        chosen = nqfjax.select_model(ts, loss)
        ok = chosen.best == "staircase" and chosen.n_modes == truth["seen"] - 1
        right += ok
        print(cell, chosen.best, chosen.n_modes, truth["seen"] - 1, chosen.reason)
    assert right == 6


#: The recorded real runs (examples/runs/record.py): the plateaus seen by
#: eye on their log-log plots.
RUNS = {
    # a sharp drop onto the floor (the linear mode; 2 fitted modes counted
    # as one drop)
    "perceptron_breast_cancer": 2,
    # a drop with a shoulder (no plateau between its modes), a second drop
    "attention_teacher": 3,
    # a small drop (0.25 in ln L) onto a slowly tilting plateau
    "conv_mnist1d": 2,
}


@pytest.mark.slow  # 3 plateau detections and model selections
def test_recorded_runs():
    """Real runs of `train` (tanh perceptron on breast_cancer, softmax
    attention, tanh conv on MNIST-1D): the plateaus seen by eye, each level
    within 3% of the data's median over the plateau (a tilted one's too), and
    `select_model` calls them staircases of at least as many modes as
    drops between plateaus (measured: 3/3; the attention run's shouldered
    first drop is 3 fitted modes)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "examples" / "runs"
    for name, plateaus in RUNS.items():
        data = np.loadtxt(folder / f"{name}.csv", delimiter=",", skiprows=2)
        ts, loss = data[1:, 0], data[1:, 1]  # step 0 has no log time
        found = nqfjax.detect_plateaus(ts, loss)
        assert len(found) == plateaus, (name, found)
        for start, end, level in zip(found.start, found.end, found.level):
            on = (ts >= start) & (ts <= end)
            assert abs(np.log(level / np.median(loss[on]))) < 0.03, (name, found)
        chosen = nqfjax.select_model(ts, loss)
        assert chosen.best == "staircase", (name, chosen)
        assert chosen.n_modes >= plateaus - 1, (name, chosen)


@pytest.mark.slow  # 39 model selections (about 2.5 min)
def test_select_model_held_out():
    """`select_model` on the held-out cells: a staircase with the number of
    drops the record sees on >= 95% (the issue's bar). Measured: 38/39 in the
    first round (one every-step logistic staircase given a drop too many:
    its first plateau one record), 39/39 since a first drop needs 3 records
    before it."""
    right = total = 0
    for cell, ts, loss, truth in _cases(HELD_OUT, 5, seed=20):
        chosen = nqfjax.select_model(ts, loss)
        right += chosen.best == "staircase" and chosen.n_modes == truth["seen"] - 1
        total += 1
    print(f"select_model held out: {right}/{total}")
    assert right >= 0.95 * total
