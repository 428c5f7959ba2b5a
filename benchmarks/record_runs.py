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

    python benchmarks/record_runs.py            # every run
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
    """`(structure, xs, ys)` of a data set."""
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


#: name: (data set, optimizer, learning rate, steps, initial scale)
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


def record(name: str):
    """`(steps, loss)` of one run."""
    dataset, opt, lr, num_steps, sigma = RUNS[name]
    structure, xs, ys = data(dataset)
    steps = np.unique(
        np.concatenate(
            [
                np.rint(np.geomspace(1, num_steps, 150)),
                np.rint(np.linspace(0, num_steps, 101)),
            ]
        ).astype(int)
    )
    run = nqfjax.train(
        structure,
        xs,
        ys,
        num_steps=num_steps,
        learning_rate=lr,
        optimizer=optax.adam if opt == "adam" else None,
        init_scale=sigma,
        width=16,
        key=jax.random.key(0),
        record_at=tuple(int(s) for s in steps),
        snapshots=False,
    )
    return np.asarray(run.ts, np.float64), np.asarray(run.loss, np.float64)


def main(names):
    os.makedirs(OUT, exist_ok=True)
    for name in names or RUNS:
        steps, loss = record(name)
        path = os.path.join(OUT, f"{name}.csv")
        # the comment line, then the column names as `nqfjax fit` reads them
        header = (
            f"# {name}: {RUNS[name]} (data set, optimizer, rate, steps, scale)"
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
