"""Record the training runs that `benchmarks/forecast_runs.py` forecasts: small
networks trained by `nqfjax.train` on real data, each saved as a CSV of
`(step, loss)` in `examples/runs/` (the full-data loss at 150 log-spaced and
100 evenly spaced steps).

The runs: tanh perceptrons on scikit-learn's iris, wine, breast cancer and
digits (500 samples, 16 principal components), a `Conv1D` (kernel 5, stride
5) on MNIST-1D (300 signals, class 2 or not), and a softmax query-key
attention head on teacher sequences; trained by plain gradient descent or by
Adam, from small initial weights (so that the modes switch on one after
another: plateaus and sudden drops). Each records in well under a minute.

`HELD_OUT` are further runs, recorded before the forecast was revised on the
runs of `RUNS` and forecast only once, after (issue 29): other seeds, other
data (diabetes, MNIST-1D's class 5, a second attention teacher), a wider
perceptron, SGD with momentum and Adam with a linear warm-up.
`HELD_OUT_2` are a third set, recorded before the forecast's second revision
(on the runs of `RUNS` and `HELD_OUT`) and forecast only once, after it:
other seeds, widths and initial scales, breast cancer with Adam, MNIST-1D's
class 7 and a third attention teacher.
`HELD_OUT_3` are a fourth set, recorded before the forecast's third revision
(its band, on all the runs before) and forecast only once, after it: other
seeds and initial scales, iris with a slower Adam, wine with Adam and 32
units, MNIST-1D's class 3 with Adam and a fourth attention teacher with GD
and with Adam.
`HELD_OUT_4` are a fifth set, recorded before the forecast's fourth revision
(on all 31 runs before) and forecast only once, after it: other seeds, wine
with momentum, digits with Adam and a warm-up, breast cancer with Adam from
3e-4, iris with GD and 64 units, MNIST-1D's class 6 with GD and a fifth
attention teacher with GD and with Adam.
`HELD_OUT_5` are a sixth set, recorded before the forecast's fifth revision
(on all 38 runs before) and forecast only once, after it: other seeds,
breast cancer with GD, 32 units and initial scale 3e-3, digits with a faster
Adam from 3e-4, iris with momentum, wine with GD and 8 units, MNIST-1D's
class 8 with Adam and a sixth attention teacher with GD and with Adam.

    python benchmarks/record_runs.py            # every run, held out too
    python benchmarks/record_runs.py iris_gd    # just these
"""

import os
import sys


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
import optax  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nqfjax  # noqa: E402


OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "runs")


def teacher_sequences(n: int, seed: int = 0, T: int = 4, d: int = 4):
    """`(xs, ys)`: `n` sequences of `T` Gaussian tokens of dimension `d`, the
    target the output of a softmax query-key head (the default values of
    `QKAttention`) whose `W_Q W_K^T` has singular values 1.5, 1.0, 0.6 in
    random orthonormal bases (as in `predict_agreement.py`), plus noise of 0.001
    (a floor the head cannot fit)."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, T, d))
    left, _ = np.linalg.qr(rng.standard_normal((d, 3)))
    right, _ = np.linalg.qr(rng.standard_normal((d, 3)))
    Wqk = (left * np.array([1.5, 1.0, 0.6])) @ right.T
    values = np.asarray(nqfjax.QKAttention(T=T, d=d).values, np.float64)[:, 0]
    logits = np.einsum("ni,ij,nbj->nb", xs[:, -1], Wqk, xs)
    alpha = np.exp(logits - logits.max(1, keepdims=True))
    alpha /= alpha.sum(1, keepdims=True)
    noise = 0.001 * rng.standard_normal(n)  # a floor: no head fits it
    return xs, (alpha @ values + noise)[:, None]


def data(name: str):
    """`(structure, xs, ys)` of a data set (`mnist1d_5`: class 5 rather than
    2; `mnist1d_7`, `mnist1d_3`: classes 7 and 3 of other signals;
    `mnist1d_6`, `mnist1d_8`: classes 6 and 8 of other signals;
    `attention_b` to `attention_f`: the teachers of seeds 1 to 5;
    `diabetes`: the regression target)."""
    if name == "diabetes":
        xs, ys = nqfjax.load_dataset("diabetes", target="label", dtype=np.float64)
        return nqfjax.Perceptron(d=xs.shape[1], k=1), xs, ys
    if name == "mnist1d_5":
        xs, ys = nqfjax.load_dataset("mnist1d", n=300, seed=1, dtype=np.float64)
        y = ys[:, 5:6]
        return nqfjax.Conv1D(length=40, kernel_size=5, stride=5), xs, y / y.std()
    if name in ("mnist1d_7", "mnist1d_3", "mnist1d_6", "mnist1d_8"):
        seed, c = {
            "mnist1d_7": (2, 7),
            "mnist1d_3": (3, 3),
            "mnist1d_6": (4, 6),
            "mnist1d_8": (5, 8),
        }[name]
        xs, ys = nqfjax.load_dataset("mnist1d", n=300, seed=seed, dtype=np.float64)
        y = ys[:, c : c + 1]
        return nqfjax.Conv1D(length=40, kernel_size=5, stride=5), xs, y / y.std()
    if name in (
        "attention_b",
        "attention_c",
        "attention_d",
        "attention_e",
        "attention_f",
    ):
        seeds = {
            "attention_b": 1,
            "attention_c": 2,
            "attention_d": 3,
            "attention_e": 4,
            "attention_f": 5,
        }
        xs, ys = teacher_sequences(256, seed=seeds[name])
        return nqfjax.QKAttention(T=4, d=4), xs, ys
    if name in ("iris", "wine", "breast_cancer"):
        xs, ys = nqfjax.load_dataset(name, dtype=np.float64)
        return nqfjax.Perceptron(d=xs.shape[1], k=ys.shape[1]), xs, ys
    if name == "digits":
        xs, ys = nqfjax.load_dataset("digits", n=500, pca=16, dtype=np.float64)
        return nqfjax.Perceptron(d=16, k=10), xs, ys
    if name == "mnist1d":
        xs, ys = nqfjax.load_dataset("mnist1d", n=300, dtype=np.float64)
        y = ys[:, 2:3]
        return nqfjax.Conv1D(length=40, kernel_size=5, stride=5), xs, y / y.std()
    if name == "attention":
        xs, ys = teacher_sequences(256)
        return nqfjax.QKAttention(T=4, d=4), xs, ys
    raise ValueError(name)


#: name: (data set, optimizer, learning rate, steps, initial scale); the
#: runs the forecast was developed on
RUNS = {
    "iris_gd": ("iris", "gd", 0.02, 20_000, 1e-3),
    "wine_gd": ("wine", "gd", 0.01, 20_000, 1e-3),
    "breast_cancer_gd": ("breast_cancer", "gd", 0.005, 20_000, 1e-3),
    "digits_gd": ("digits", "gd", 0.02, 20_000, 1e-3),
    "mnist1d_gd": ("mnist1d", "gd", 0.04, 20_000, 1e-3),
    "attention_gd": ("attention", "gd", 0.1, 20_000, 1e-2),
    "iris_adam": ("iris", "adam", 1e-3, 10_000, 1e-3),
    "digits_adam": ("digits", "adam", 3e-4, 10_000, 1e-3),
    "mnist1d_adam": ("mnist1d", "adam", 1e-3, 10_000, 1e-3),
    "attention_adam": ("attention", "adam", 2e-4, 10_000, 1e-2),
    "wine_adam": ("wine", "adam", 3e-4, 10_000, 1e-3),
}

#: name: (data set, optimizer, learning rate, steps, initial scale, width,
#: seed); held out from the forecast's development (see the module notes)
HELD_OUT = {
    "digits_momentum": ("digits", "momentum", 0.002, 20_000, 1e-3, 16, 1),
    "wine_adam_warmup": ("wine", "adam_warmup", 1e-3, 10_000, 1e-3, 16, 2),
    "digits_wide_gd": ("digits", "gd", 0.02, 20_000, 1e-3, 64, 3),
    "diabetes_gd": ("diabetes", "gd", 0.01, 20_000, 1e-3, 16, 4),
    "mnist1d_5_adam": ("mnist1d_5", "adam", 1e-3, 10_000, 1e-3, 16, 5),
    "attention_b_momentum": ("attention_b", "momentum", 0.02, 20_000, 1e-2, 16, 6),
}

#: name: (data set, optimizer, learning rate, steps, initial scale, width,
#: seed); the third set, held out from the forecast's second revision
HELD_OUT_2 = {
    "iris_wide_gd": ("iris", "gd", 0.02, 20_000, 3e-3, 32, 7),
    "breast_cancer_adam": ("breast_cancer", "adam", 3e-4, 10_000, 1e-3, 16, 8),
    "wine_gd_b": ("wine", "gd", 0.01, 20_000, 3e-4, 16, 9),
    "digits_wide_adam": ("digits", "adam", 3e-4, 10_000, 3e-4, 32, 10),
    "mnist1d_7_gd": ("mnist1d_7", "gd", 0.04, 20_000, 1e-3, 16, 11),
    "attention_c_adam": ("attention_c", "adam", 2e-4, 10_000, 1e-2, 16, 12),
    "attention_c_gd": ("attention_c", "gd", 0.1, 20_000, 1e-2, 16, 13),
}

#: name: (data set, optimizer, learning rate, steps, initial scale, width,
#: seed); the fourth set, held out from the forecast's third revision
HELD_OUT_3 = {
    "iris_adam_b": ("iris", "adam", 3e-4, 10_000, 3e-4, 16, 14),
    "wine_wide_adam": ("wine", "adam", 1e-3, 10_000, 1e-3, 32, 15),
    "breast_cancer_gd_b": ("breast_cancer", "gd", 0.01, 20_000, 3e-4, 16, 16),
    "digits_gd_b": ("digits", "gd", 0.04, 20_000, 3e-4, 16, 17),
    "mnist1d_3_adam": ("mnist1d_3", "adam", 3e-4, 10_000, 1e-3, 16, 18),
    "attention_d_gd": ("attention_d", "gd", 0.05, 20_000, 1e-2, 16, 19),
    "attention_d_adam": ("attention_d", "adam", 5e-4, 10_000, 1e-2, 16, 20),
}

#: name: (data set, optimizer, learning rate, steps, initial scale, width,
#: seed); the fifth set, held out from the forecast's fourth revision
HELD_OUT_4 = {
    "wine_momentum": ("wine", "momentum", 0.002, 20_000, 1e-3, 16, 21),
    "digits_adam_warmup": ("digits", "adam_warmup", 1e-3, 10_000, 1e-3, 16, 22),
    "breast_cancer_adam_b": ("breast_cancer", "adam", 3e-4, 10_000, 3e-4, 16, 23),
    "iris_wider_gd": ("iris", "gd", 0.02, 20_000, 1e-3, 64, 24),
    "mnist1d_6_gd": ("mnist1d_6", "gd", 0.04, 20_000, 1e-3, 16, 25),
    "attention_e_gd": ("attention_e", "gd", 0.1, 20_000, 1e-2, 16, 26),
    "attention_e_adam": ("attention_e", "adam", 2e-4, 10_000, 1e-2, 16, 27),
}

#: name: (data set, optimizer, learning rate, steps, initial scale, width,
#: seed); the sixth set, held out from the forecast's fifth revision
HELD_OUT_5 = {
    "breast_cancer_wide_gd": ("breast_cancer", "gd", 0.005, 20_000, 3e-3, 32, 28),
    "digits_adam_b": ("digits", "adam", 1e-3, 10_000, 3e-4, 16, 29),
    "iris_momentum": ("iris", "momentum", 0.005, 20_000, 1e-3, 16, 30),
    "wine_narrow_gd": ("wine", "gd", 0.02, 20_000, 1e-3, 8, 31),
    "mnist1d_8_adam": ("mnist1d_8", "adam", 1e-3, 10_000, 1e-3, 16, 32),
    "attention_f_gd": ("attention_f", "gd", 0.1, 20_000, 1e-2, 16, 33),
    "attention_f_adam": ("attention_f", "adam", 3e-4, 10_000, 1e-2, 16, 34),
}

#: every run, by name: (data set, optimizer, rate, steps, scale, width, seed)
ALL = {
    **{k: (*v, 16, 0) for k, v in RUNS.items()},
    **HELD_OUT,
    **HELD_OUT_2,
    **HELD_OUT_3,
    **HELD_OUT_4,
    **HELD_OUT_5,
}


def _momentum(lr):
    return optax.sgd(lr, momentum=0.9)


#: the optimizer factories (created once: `train` compiles per factory)
OPTIMIZERS = {"gd": None, "adam": optax.adam, "momentum": _momentum}


def _optimizer(opt: str, lr: float, num_steps: int):
    """`(learning_rate, optimizer)` for `train`: `adam_warmup` is Adam whose
    rate rises linearly from 0 over the first tenth of the steps."""
    if opt == "adam_warmup":
        return optax.linear_schedule(0.0, lr, num_steps // 10), optax.adam
    return lr, OPTIMIZERS[opt]


def record(name: str):
    """`(steps, loss)` of one run."""
    dataset, opt, lr, num_steps, sigma, width, seed = ALL[name]
    structure, xs, ys = data(dataset)
    steps = np.unique(
        np.concatenate(
            [
                np.rint(np.geomspace(1, num_steps, 150)),
                np.rint(np.linspace(0, num_steps, 101)),
            ]
        ).astype(int)
    )
    rate, optimizer = _optimizer(opt, lr, num_steps)
    run = nqfjax.train(
        structure,
        xs,
        ys,
        num_steps=num_steps,
        learning_rate=rate,
        optimizer=optimizer,
        init_scale=sigma,
        width=width,
        key=jax.random.key(seed),
        record_at=tuple(int(s) for s in steps),
        snapshots=False,
    )
    return np.asarray(run.ts, np.float64), np.asarray(run.loss, np.float64)


def main(names):
    os.makedirs(OUT, exist_ok=True)
    for name in names or ALL:
        steps, loss = record(name)
        path = os.path.join(OUT, f"{name}.csv")
        # the comment line, then the column names as `nqfjax fit` reads them
        header = (
            f"# {name}: {ALL[name]} (data set, optimizer, rate, steps, scale, "
            "width, seed)"
            "\nstep,loss"
        )
        np.savetxt(
            path,
            np.column_stack([steps, loss]),
            fmt=["%d", "%.10g"],
            delimiter=",",
            header=header,
            comments="",
        )
        print(f"{name}: {len(steps)} records, loss {loss[0]:.3g} -> {loss[-1]:.3g}")


if __name__ == "__main__":
    main(sys.argv[1:])
