"""Subprocess worker for the kill-and-resume test of `nqfjax.sweep` (test_sweep.py).

Usage: `python tests/_sweep_worker.py CHECKPOINT LOG OUT GATE`.

Runs `sweep(point, GRID, checkpoint=CHECKPOINT, chunk=CHUNK)`. Every evaluated grid
point appends its index to LOG (through `jax.debug.callback`, so the log counts real
evaluations, not traces). Points of chunk 2 and later block until the file GATE
exists, so a first run can be killed deterministically while chunk 2 is in flight.
The outputs are saved to OUT (npz) with the chunk counts.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


jax.config.update("jax_enable_x64", True)

N = 24
CHUNK = 4
GRID = {"index": np.arange(N), "log_sigma": np.linspace(-8.0, -2.0, N)}


def make_point(log_path: str | None, gate: str | None):
    """The swept function of one point: a small logistic-mode loss curve, computed
    by 200 explicit Euler steps of two independent LV modes from `m0 = sigma^2`."""

    def record(index):
        if log_path is not None:
            with open(log_path, "a") as f:
                f.write(f"{int(index)}\n")
        if gate is not None and int(index) >= 2 * CHUNK:
            while not os.path.exists(gate):
                time.sleep(0.02)

    def point(index, log_sigma):
        jax.debug.callback(record, index)
        r = jnp.array([1.0, 0.3])
        b = jnp.array([1.0, 0.5])

        def step(m, _):
            m = m + 0.05 * m * (r - b * m)
            return m, 0.5 * jnp.sum(b * (r / b - m) ** 2)

        m0 = jnp.exp(2 * log_sigma) * jnp.ones(2)
        _, losses = jax.lax.scan(step, m0, None, length=200)
        return {"loss": losses[::20], "final": losses[-1]}

    return point


def main():
    from nqfjax import sweep

    ckpt, log_path, out, gate = sys.argv[1:5]
    result = sweep(
        make_point(log_path, gate), GRID, checkpoint=ckpt, chunk=CHUNK, progress=False
    )
    np.savez(
        out,
        loss=np.asarray(result.outputs["loss"]),
        final=np.asarray(result.outputs["final"]),
        n_loaded=result.n_loaded,
        n_computed=result.n_computed,
    )


if __name__ == "__main__":
    main()
