"""Record the real training runs of this folder with nqfjax's own `train`
(full-batch GD from a small initialisation, width 8, 300 log-spaced records
over 10^4 steps, 4 10^4 for the perceptron, whose second drop is slow;
10-30 s each on a CPU):

- `perceptron_breast_cancer.csv`: a tanh `Perceptron` on breast_cancer (6
  whitened principal components, the label scaled by 0.2), learning rate
  0.15: a sharp drop (the linear mode) and a gentle, asymmetric one (tanh's
  cubic term), three plateaus;
- `attention_teacher.csv`: softmax `QKAttention` (T = 4 tokens, d = 4, k = 3)
  on Gaussian tokens labelled by a teacher of three units of scales 2, 0.7,
  0.25, plus 1% label noise, learning rate 0.2: three plateaus, the first
  drop with a shoulder (two modes switching on without a plateau between);
- `conv_mnist1d.csv`: a tanh `Conv1D` (kernel 5, stride 5) on 1000 MNIST-1D
  signals, the label scaled by 0.3, plus 1% label noise, learning rate 0.05:
  one small drop (0.25 in ln L) onto a slowly tilting plateau: two plateaus.

Run `python examples/runs/record.py` from the repository root to record them
again (needs the extra `nqfjax[data]`)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import nqfjax


def _runs():
    rng = np.random.default_rng(0)
    xs, ys = nqfjax.load_dataset("breast_cancer", pca=6, whiten=True, target="label")
    structure = nqfjax.Perceptron(d=xs.shape[1], k=1)
    yield "perceptron_breast_cancer", structure, xs, 0.05 * ys, 0.15, 10_000
    structure = nqfjax.QKAttention(T=4, d=4, k=3)
    xs = rng.normal(size=(512, 4, 4)).astype(np.float32)
    teacher = np.zeros((8, 3), np.float32)
    for i, s in enumerate([2.0, 0.7, 0.25]):
        teacher[i, i] = teacher[4 + i, i] = s
    ys = np.asarray(jax.vmap(lambda x: structure.layer(jnp.asarray(teacher), x))(xs))
    ys = ys + 0.01 * rng.normal(size=ys.shape).astype(np.float32)
    yield "attention_teacher", structure, xs, ys, 0.2, 10_000
    xs, ys = nqfjax.load_dataset("mnist1d", n=1000, target="label")
    structure = nqfjax.Conv1D(length=xs.shape[1], kernel_size=5, stride=5)
    ys = 0.3 * ys + 0.01 * rng.normal(size=ys.shape).astype(np.float32)
    yield "conv_mnist1d", structure, xs, ys, 0.05, 10_000


def main(folder=Path(__file__).parent):
    for name, structure, xs, ys, eta, num_steps in _runs():
        record = nqfjax.log_spaced_steps(num_steps, 300)
        run = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=num_steps,
            learning_rate=eta,
            key=jax.random.key(0),
            init_scale=1e-5,
            width=8,
            record_at=record,
            snapshots=False,
        )
        rows = np.column_stack([record, np.asarray(run.loss, np.float64)])
        np.savetxt(
            folder / f"{name}.csv",
            rows,
            fmt=["%d", "%.8g"],
            delimiter=",",
            header=f"# {name}: recorded by examples/runs/record.py\nstep,loss",
            comments="",
        )


if __name__ == "__main__":
    main()
