"""Subprocess worker for the kill-and-resume tests of `nqfjax.sweep` (test_sweep.py,
test_distributed.py).

Usage: `python tests/_sweep_worker.py CHECKPOINT LOG OUT GATE [options]`.

Runs `sweep(point, GRID, checkpoint=CHECKPOINT, chunk=CHUNK)` (no checkpoint if
CHECKPOINT is empty), over a mesh of every device (`jax.devices()`) when there is
more than one. The point runs one of the library's engines (`--engine`): `solve_lv`
(the default: a three-mode interacting system, an adaptive solve whose step count
depends on the point) or `train` (gradient descent of a tanh perceptron), both from
an init scale `sigma = exp(log_sigma)`. Every evaluated grid point appends its index
to LOG (through `jax.debug.callback`, so the log counts real evaluations, not traces).
Points of chunk 2 and later block until the file GATE exists, so a first run can be
killed deterministically while chunk 2 is in flight. The outputs are saved to OUT
(npz) with the chunk counts.

Options: `--engine NAME` (above); `--process I --processes N --port P` join a multi-
process run through `jax.distributed.initialize` with its coordinator on
127.0.0.1:P; `--shift X` adds X to the grid's `log_sigma` (a process called with
another grid); `--dump DIR` has process 0 write the optimized chunk program of the
sweep (`sweep.hlo`) and of a plain sharded `jit` of the same function (`jit.hlo`) to
DIR.
"""

import argparse
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


def _solve_lv_point(log_sigma):
    """The loss curve of a three-mode interacting LV system from `m0 = sigma^2
    (1, 2, 3)`, solved by `nqfjax.solve_lv` (its default Rosenbrock solver)."""
    import nqfjax

    r = jnp.array([1.0, 0.5, 0.2])
    B = jnp.array([[1.0, 0.2, 0.1], [0.2, 1.0, 0.3], [0.1, 0.3, 0.8]])
    lv = nqfjax.LotkaVolterra(r, B)
    m0 = jnp.exp(2 * log_sigma) * jnp.arange(1.0, 4.0)
    sol = nqfjax.solve_lv(lv, m0, jnp.linspace(1.0, 80.0, 10))
    return {"loss": sol.loss, "final": sol.loss[-1], "steps": sol.stats["num_steps"]}


def _train_point(log_sigma):
    """The loss curve of full-batch gradient descent of a tanh perceptron (d = 4,
    k = 2, 4 units) on 16 fixed samples, from `W = sigma Z`, by `nqfjax.train`."""
    import nqfjax

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(16, 4))
    ys = xs @ (0.3 * rng.normal(size=(2, 4))).T
    net = nqfjax.Perceptron(d=4, k=2)
    res = nqfjax.train(
        net,
        xs,
        ys,
        num_steps=300,
        learning_rate=0.5,
        init_scale=jnp.exp(log_sigma),
        width=4,
        key=jax.random.key(0),
        num_records=10,
        snapshots=False,
    )
    return {"loss": res.loss, "final": res.loss[-1]}


ENGINES = {"solve_lv": _solve_lv_point, "train": _train_point}


def make_point(log_path: str | None, gate: str | None, engine: str = "solve_lv"):
    """The swept function of one point: `ENGINES[engine]` at `log_sigma`, after
    logging (and gating) the point's index."""

    def record(index):
        if log_path:
            with open(log_path, "a") as f:
                f.write(f"{int(index)}\n")
        if gate and int(index) >= 2 * CHUNK:
            while not os.path.exists(gate):
                time.sleep(0.02)

    def point(index, log_sigma):
        jax.debug.callback(record, index)
        return ENGINES[engine](log_sigma)

    return point


def _dump(point, grid, mesh, folder):
    """The optimized HLO of the sweep's cached chunk program, and of the plain
    sharded `jit` it replaces."""
    from jax.sharding import NamedSharding, PartitionSpec

    programs = sys.modules["nqfjax.sweep"]._PROGRAMS[point]
    (program,) = programs.values()
    sharding = NamedSharding(mesh, PartitionSpec("sweep"))
    inputs = {
        name: jax.make_array_from_callback(
            (CHUNK,), sharding, lambda s, a=a: a[:CHUNK][s]
        )
        for name, a in grid.items()
    }
    plain = jax.jit(
        jax.vmap(lambda p: point(**p)), in_shardings=(sharding,), out_shardings=sharding
    )
    texts = {
        "sweep.hlo": program.compiled().as_text(),
        "jit.hlo": plain.lower(inputs).compile().as_text(),
    }
    if jax.process_index() == 0:
        os.makedirs(folder, exist_ok=True)
        for name, text in texts.items():
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)


def main():
    parser = argparse.ArgumentParser()
    for name in ("checkpoint", "log", "out", "gate"):
        parser.add_argument(name)
    parser.add_argument("--process", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--shift", type=float, default=0.0)
    parser.add_argument("--dump", default="")
    parser.add_argument("--engine", default="solve_lv")
    args = parser.parse_args()
    if args.processes > 1:
        jax.distributed.initialize(
            f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.process,
            initialization_timeout=120,
            heartbeat_timeout_seconds=10,
        )

    from jax.sharding import Mesh

    from nqfjax import sweep

    mesh = None
    if len(jax.devices()) > 1:
        mesh = Mesh(np.array(jax.devices()), ("sweep",))
    point = make_point(args.log, args.gate, args.engine)
    grid = {"index": GRID["index"], "log_sigma": GRID["log_sigma"] + args.shift}
    result = sweep(
        point,
        grid,
        mesh=mesh,
        checkpoint=args.checkpoint or None,
        chunk=CHUNK,
        progress=False,
    )
    if args.dump:
        _dump(point, grid, mesh, args.dump)
    np.savez(
        args.out,
        **{k: np.asarray(v) for k, v in result.outputs.items()},
        n_loaded=result.n_loaded,
        n_computed=result.n_computed,
        devices=np.asarray(result.devices),
        shard_size=result.shard_size,
    )


if __name__ == "__main__":
    main()
