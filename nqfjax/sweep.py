"""jit + vmap sweeps over hyperparameter grids, sharded over devices and processes,
checkpointed.

One compiled, vmapped call per chunk of grid points. With a `jax.sharding.Mesh`
the chunk is split along the sweep axis over the devices of a named mesh axis,
each device running its own points' loop (`jax.shard_map`: no collective inside
the solve), the mesh possibly spanning several processes (`jax.distributed`).
With a checkpoint folder each finished chunk is written atomically and verified
when read back, and a restarted sweep resumes where it stopped. The compiled
chunk program is kept across calls with the same function and shapes.
"""

import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree

from ._checkpoint import (
    Checkpoint,
    CheckpointWarning as CheckpointWarning,
    agree,
    any_process,
    load_chunks,
    serialise,
    sync_chunks,
)
from ._checks import deferred_errors
from .progress import AbstractProgressMeter, NoProgressMeter, as_progress_meter


_FORMAT = 2  # of the checkpoint: 2 adds each chunk's size and SHA-256


class SweepResult(eqx.Module):
    """The outputs of a sweep, keyed by its grid.

    **Fields:**

    - `grid`: the grid points, a dict `name -> array` of leading length `N` (the
      same arrays that were passed, after validation and dtype canonicalisation).
    - `outputs`: the pytree returned by `fn`, every leaf with a leading sweep axis of
      length `N`: `outputs[i]` is `fn(**{name: grid[name][i]})`.
    - `n_chunks`: number of chunks the grid was split into.
    - `n_computed`, `n_loaded`: how many chunks this call computed, and how many it
      read back from the checkpoint (`n_computed + n_loaded == n_chunks`).
    - `devices`: ids of the devices holding a shard of the sweep axis in the last
      computed chunk (ordered by shard, over every process); empty if nothing was
      computed.
    - `shard_size`: points of the (padded) chunk held by each of those devices.
    - `damaged`: the checkpoint chunk files found damaged (or not matching the
      manifest) and recomputed by this call.
    - `per_device`: over a mesh, whether each device ran its own points' loops
      (`shard_map`), or the devices stepped together (a sharded `jit`: the
      fallback for a function that cannot be traced inside `shard_map`).
    """

    grid: dict[str, Array]
    outputs: PyTree
    n_chunks: int = eqx.field(static=True)
    n_computed: int = eqx.field(static=True)
    n_loaded: int = eqx.field(static=True)
    devices: tuple[int, ...] = eqx.field(static=True, default=())
    shard_size: int = eqx.field(static=True, default=0)
    damaged: tuple[str, ...] = eqx.field(static=True, default=())
    per_device: bool = eqx.field(static=True, default=True)

    def __len__(self) -> int:
        return int(next(iter(self.grid.values())).shape[0])


def grid_product(axes: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The Cartesian product of 1-D axes, flattened into zipped grid points.

    `sweep` takes *zipped* grids (point `i` is `{name: grid[name][i]}`); this turns
    a product specification into one. The order is C order (the last axis varies
    fastest), so `outputs` reshape to `tuple(len(a) for a in axes.values())`.

    **Arguments:**

    - `axes`: dict `name -> 1-D array`, each non-empty.

    **Returns:** dict `name -> 1-D array` of length `prod(len(a))`.

    **Raises:** `ValueError` if `axes` is empty or an axis is not a non-empty 1-D
    array.
    """
    if not isinstance(axes, Mapping) or len(axes) == 0:
        raise ValueError("`axes` must be a non-empty dict name -> 1-D array.")
    arrays = {}
    for name, values in axes.items():
        a = np.asarray(values)
        if a.ndim != 1 or a.shape[0] == 0:
            raise ValueError(
                f"`axes[{name!r}]` must be a non-empty 1-D array, got shape {a.shape}."
            )
        arrays[name] = a
    mesh = np.meshgrid(*arrays.values(), indexing="ij")
    return {name: m.reshape(-1) for name, m in zip(arrays, mesh)}


def _check_grid(grid) -> tuple[dict[str, np.ndarray], int]:
    if not isinstance(grid, Mapping):
        raise ValueError(
            f"`grid` must be a dict name -> array of grid points, got {type(grid)}."
        )
    if len(grid) == 0:
        raise ValueError("`grid` is empty: give at least one name -> array.")
    out = {}
    lengths = {}
    for name, values in grid.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"`grid` keys must be valid argument names of `fn`, got {name!r}."
            )
        try:
            a = np.asarray(values)
        except Exception as e:  # e.g. typed PRNG key arrays
            raise ValueError(
                f"`grid[{name!r}]` must be a numeric array; pass integer seeds "
                "instead of PRNG keys and build the key inside `fn`."
            ) from e
        if a.dtype.kind not in "biuf":
            raise ValueError(
                f"`grid[{name!r}]` must be numeric (bool, int or float), got dtype "
                f"{a.dtype}."
            )
        if a.ndim == 0:
            raise ValueError(
                f"`grid[{name!r}]` must be an array with a leading sweep axis, got a "
                "scalar; wrap it in a list or close over it in `fn`."
            )
        if a.shape[0] == 0:
            raise ValueError(f"`grid[{name!r}]` is empty: a sweep needs >= 1 point.")
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise ValueError(f"`grid[{name!r}]` contains NaN or inf.")
        a = a.astype(jax.dtypes.canonicalize_dtype(a.dtype))
        out[name] = np.ascontiguousarray(a)
        lengths[name] = a.shape[0]
    if len(set(lengths.values())) != 1:
        raise ValueError(
            "every `grid` array must have the same leading length (the grid is a "
            f"zipped list of points; use `grid_product` for a product), got {lengths}."
        )
    return out, next(iter(lengths.values()))


def _fn_name(fn) -> str:
    base = fn
    while hasattr(base, "func"):  # functools.partial
        base = base.func
    name = getattr(base, "__qualname__", None) or type(base).__qualname__
    return f"{getattr(base, '__module__', '')}.{name}"


def _fingerprint(fn, grid, chunk, out_info, tag) -> str:
    h = hashlib.sha256()
    meta = {
        "format": _FORMAT,
        "fn": _fn_name(fn),
        "tag": tag,
        "chunk": chunk,
        "names": list(grid),
        "grid": [(str(a.dtype), a.shape) for a in grid.values()],
        "outputs": [(str(s.dtype), s.shape) for s in jax.tree.leaves(out_info)],
        "treedef": str(jax.tree.structure(out_info)),
    }
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for a in grid.values():
        h.update(a.tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------
# interrupts


class _Deferred:
    """A SIGINT handler that records the interrupt instead of raising it; a second
    SIGINT raises `KeyboardInterrupt` at once."""

    def __init__(self):
        self.pending = False

    def __call__(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True
        # os.write, not print: the main thread may be inside a write to stderr
        # (a progress bar), and a buffered stream refuses a reentrant write
        message = (
            "\nnqfjax: interrupted: stopping once the chunk in progress is saved "
            "(press Ctrl-C again to stop at once)\n"
        )
        try:
            os.write(sys.stderr.fileno(), message.encode())
        except (AttributeError, OSError, ValueError):  # no file descriptor
            pass


@contextlib.contextmanager
def defer_interrupts() -> Iterator[Callable[[], bool]]:
    """Hold SIGINT (Ctrl-C) back to the safe points of a block.

    Inside the block a SIGINT only records that it came; the block asks
    `interrupted()` at its safe points (between chunks, after a chunk is saved)
    and raises `KeyboardInterrupt` there, and leaving the block normally raises
    it if one came. A `KeyboardInterrupt` raised at an arbitrary bytecode --
    in the middle of tracing, or while XLA threads run -- can leave JAX's state
    half-changed and crash the interpreter; this keeps it out of those places.
    A second SIGINT raises at once. Nested blocks share the outermost one's
    record; outside the main thread (where Python runs no signal handlers) the
    block changes nothing and `interrupted()` is always `False`.

    **Returns:** a context manager yielding `interrupted() -> bool`.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.getsignal(signal.SIGINT)
    if isinstance(previous, _Deferred):  # nested: the outer block raises
        yield lambda: previous.pending
        return
    if previous is None:  # a handler installed from C: leave it alone
        yield lambda: False
        return
    handler = _Deferred()
    signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: handler.pending
    finally:
        signal.signal(signal.SIGINT, previous)
    if handler.pending:
        raise KeyboardInterrupt


# --------------------------------------------------------------------------------
# the compiled chunk program, cached per function


class _Program:
    """A traced chunk program, compiled on first use; `per_device` says whether
    each device runs its own points' loops (`shard_map`) or the devices step
    together (a sharded `jit`)."""

    def __init__(self, traced, per_device: bool):
        self.out_info = traced.out_info
        self.per_device = per_device
        self._traced = traced
        self._compiled = None

    def compiled(self):
        if self._compiled is None:
            self._compiled = self._traced.lower().compile()
            self._traced = None
        return self._compiled


# fn -> {(mesh, axis name, x64, input shapes and dtypes): _Program}; dropped with fn
_PROGRAMS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _jit_chunk(fn, mesh: Mesh | None, axis_name: str, per_device: bool = True):
    def point_fn(point):
        return fn(**point)

    batched = jax.vmap(point_fn)
    if mesh is None:
        return jax.jit(batched)
    spec = PartitionSpec(axis_name)
    sharding = NamedSharding(mesh, spec)
    if per_device:
        # Each device loops over its own points: under a plain sharded `jit` the
        # partitioner would all-reduce a batched while loop's condition at every
        # step, stepping every device (and process) in lockstep. No collective
        # runs inside, so the varying-axes types are not checked
        # (`check_vma=False`): diffrax's loops and equinox's checks lack them.
        batched = jax.shard_map(
            batched, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False
        )
    return jax.jit(batched, in_shardings=(sharding,), out_shardings=sharding)


def _chunk_program(fn, inputs: dict, mesh: Mesh | None, axis_name: str) -> _Program:
    """The chunk program of `fn` for inputs shaped like `inputs`, from the cache
    when `fn` was swept with the same shapes, mesh and precision before.

    Over a mesh, the devices run their own loops (`shard_map`) where `fn` can be
    traced so; a function that cannot (lineax's linear solves, inside diffrax's
    implicit solvers, refuse the vectors of a `shard_map`) runs as a sharded
    `jit`, its loops in lockstep over the devices: the same numbers, slower."""
    key = (
        mesh,
        axis_name,
        bool(jax.config.jax_enable_x64),
        tuple((k, v.shape, str(v.dtype)) for k, v in inputs.items()),
    )
    try:
        cache = _PROGRAMS.setdefault(fn, {})
    except TypeError:  # not weakly referenceable (e.g. a bound method): no cache
        cache = {}
    if key not in cache:
        try:
            traced = _jit_chunk(fn, mesh, axis_name).trace(inputs)
            cache[key] = _Program(traced, per_device=True)
        except Exception as error:
            if mesh is None:
                raise
            try:
                traced = _jit_chunk(fn, mesh, axis_name, per_device=False)
                cache[key] = _Program(traced.trace(inputs), per_device=False)
            except Exception:
                raise error from None
    return cache[key]


def _to_host(x) -> np.ndarray:
    if not x.is_fully_addressable:  # a mesh over several processes: gather it
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _shard_devices(x) -> tuple[tuple[int, ...], int]:
    """The devices holding a shard of `x`'s leading axis, by shard, and its size."""
    index = x.sharding.devices_indices_map(x.shape)
    order = sorted(index, key=lambda d: (index[d][0].start or 0, d.id))
    devices = tuple(dict.fromkeys(d.id for d in order))
    first = index[order[0]][0]
    return devices, len(range(*first.indices(x.shape[0])))


# --------------------------------------------------------------------------------
# the sweep


class SweepPointError(ValueError):
    """A runtime check failed at a point of a sweep's chunk (a `ValueError`).

    **Fields:** `messages` (the failed checks' messages, empty on a process that
    saw none of them), `chunk` (its index) and `points` (the indices of its
    grid points, a `range`).
    """

    def __init__(self, text: str, messages: tuple[str, ...], chunk: int, points):
        super().__init__(text)
        self.messages = messages
        self.chunk = chunk
        self.points = points


def _point_error(failed, i, rows, chunk, grid, ckpt) -> SweepPointError:
    points = range(i * chunk, i * chunk + rows)
    values = ", ".join(
        f"{name} in [{a[points.start].item():.6g}, {a[points.stop - 1].item():.6g}]"
        for name, a in grid.items()
        if a.ndim == 1
    )
    if not failed:
        what = "a check failed on another process"
    elif len(failed) == 1:
        what = failed[0]
    else:  # the first check that failed, the later ones ran on its bad values
        what = f"{failed[0]} (and {len(failed) - 1} later check(s))"
    kept = (
        "the chunks finished before it are saved in the checkpoint"
        if ckpt is not None
        else "pass `checkpoint=` to keep the chunks that finish"
    )
    return SweepPointError(
        f"sweep: a point of chunk {i} (points {points.start}-{points.stop - 1}"
        f"{': ' + values if values else ''}) failed: {what} ({kept}).",
        tuple(failed),
        i,
        points,
    )


def _check_mesh(mesh, axis_name) -> tuple[int, NamedSharding | None, bool]:
    """The number of devices along the sweep axis, the sharding of the sweep axis,
    and whether the mesh spans several processes."""
    if mesh is None:
        return 1, None, False
    if not isinstance(mesh, Mesh):
        raise ValueError(f"`mesh` must be a jax.sharding.Mesh, got {type(mesh)}.")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"`mesh` has no axis named {axis_name!r} (its axes are "
            f"{mesh.axis_names}); pass `axis_name=` one of them."
        )
    processes = {d.process_index for d in mesh.devices.flat}
    if len(processes) > 1 and len(processes) != jax.process_count():
        raise ValueError(
            f"`mesh` spans processes {sorted(processes)} of {jax.process_count()}: "
            "a multi-process sweep needs a mesh over the devices of every process."
        )
    if jax.process_index() not in processes:
        raise ValueError(
            f"`mesh` holds no device of this process ({jax.process_index()})."
        )
    sharding = NamedSharding(mesh, PartitionSpec(axis_name))
    return int(mesh.shape[axis_name]), sharding, len(processes) > 1


def sweep(
    fn: Callable[..., PyTree],
    grid: Mapping[str, Any],
    mesh: Mesh | None = None,
    checkpoint: str | os.PathLike | None = None,
    chunk: int | None = None,
    *,
    axis_name: str = "sweep",
    progress: bool | str | AbstractProgressMeter = True,
    tag: str | None = None,
) -> SweepResult:
    r"""Run `fn` at every point of a hyperparameter grid: jit-compiled, vmapped, in
    chunks, optionally sharded over devices and processes, and checkpointed.

    The grid is a *zipped* list of points: `grid = {name: values}` with every
    `values` of the same leading length `N`, and point `i` is the keyword call
    `fn(**{name: values[i]})`. Build a Cartesian product with `grid_product`. `fn`
    must be traceable (`jax.jit(jax.vmap(...))` is applied to it) and return a
    pytree of arrays; close over everything that is not swept (`functools.partial`
    or a closure). Anything that branches on a swept value in Python (a batch
    size, a number of steps) cannot be swept this way.

    The points are processed in chunks of `chunk` points. Every chunk is padded to
    the same shape (the last one by repeating its last point; padded results are
    dropped), so `fn` is traced and compiled once. The compiled program is kept
    (while `fn` lives) and reused by later calls with the same `fn`, grid shapes
    and dtypes, mesh and `jax_enable_x64`: a second call compiles nothing. Like
    `jax.jit`, it keys on the identity of `fn`: arrays `fn` closes over are
    constants of the program, so change `fn` (not the arrays) to change them.

    **Devices.** With `mesh`, each chunk's sweep axis is split with
    `NamedSharding(mesh, PartitionSpec(axis_name))` over the devices along the mesh
    axis `axis_name` (replicated over any other mesh axis), the chunk padded to a
    multiple of their number. Each device runs the vmapped `fn` on its own points
    (`jax.shard_map`), so an adaptive solver's loop runs as long as that device's
    points need, with no collective inside it; the results are gathered after
    each chunk. A function that cannot be traced inside `shard_map` (today: one
    that calls diffrax's implicit solvers, such as `solve_mflow`'s default
    `Kvaerno5`, whose lineax solves refuse a `shard_map`'s vectors) runs as a
    sharded `jit` instead, its loops stepping together on every device: the
    same results, slower; `SweepResult.per_device` says which ran. For one host
    with several devices, `Mesh(jax.devices(), ("sweep",))`; for testing on CPU,
    `XLA_FLAGS=--xla_force_host_platform_device_count=8`.

    **Runtime checks.** A library function's value checks (a negative init
    scale, a solve that ran out of steps) do not raise on the devices: they are
    recorded while the chunk runs and raised after it as a `SweepPointError`
    (a `ValueError`) naming the check and the chunk's points; the chunks finished
    before it stay in the checkpoint. Pass `throw=False` to a solver to get its
    result code as an output instead.

    **Several processes.** Call `jax.distributed.initialize()` in every process,
    build the mesh from the global `jax.devices()`, and call `sweep` with
    identical arguments in every process (different arguments raise `ValueError`
    in all of them). Every process gets all results. Only process 0 reads the
    checkpoint's manifest and decides which chunks are done; it broadcasts that
    and each chunk's hash, the others read those chunks from their own
    `checkpoint` folder where the hashes match (a shared file system) and receive
    the rest from process 0, so processes on hosts without a shared file system
    agree. Only process 0 writes. A process killed mid-sweep makes the others fail
    at their next collective; rerun all of them to resume. Without a mesh over
    several processes, each process runs, and checkpoints, a sweep of its own
    (give each its own folder).

    **Checkpointing.** With `checkpoint=path` (a folder), the folder holds a
    `manifest.json` (a fingerprint of the function name, `tag`, the grid names,
    dtypes and values, the chunk size and the output structure, and each finished
    chunk's size and SHA-256) and one `chunk_XXXXXX.npz` per finished chunk, each
    written atomically and then entered in the manifest. A restarted sweep loads
    the chunks whose size and hash match the manifest and computes the rest: a
    damaged chunk is named in a `UserWarning` (and in `damaged`) and recomputed; a
    chunk file the manifest does not list (a partial write, or left by another
    sweep whose manifest was deleted) is never loaded. The chunk layout does not
    depend on the number of devices, so a sweep may be resumed on another machine.
    A folder of a different sweep, or with a corrupt manifest, raises `ValueError`.
    The fingerprint cannot see a change in the *body* of `fn`: change `tag` (or
    the folder) when the function changes.

    **Interrupting.** A SIGINT (Ctrl-C) stops the sweep once the chunk in progress
    is saved, with `KeyboardInterrupt` (a second one stops at once); the
    checkpoint stays whole either way.

    **Gradients.** `fn` may itself use `jax.grad` (e.g. the gradient of a loss
    through `solve_lv` with respect to a hyperparameter); `sweep` is a host-level
    driver and is not itself differentiable or jit-able.

    **Arguments:**

    - `fn`: the function of one grid point, called with the grid names as keyword
      arguments, returning a pytree of arrays.
    - `grid`: dict `name -> array` with a common leading length `N >= 1` (further
      axes are passed to `fn` per point); numeric, finite.
    - `mesh`: optional `jax.sharding.Mesh` with an axis called `axis_name`.
    - `checkpoint`: optional folder for resumable sweeps.
    - `chunk`: points per chunk (default: all `N` in one chunk).
    - `axis_name`: the mesh axis to shard the sweep over (default `"sweep"`).
    - `progress`: a progress meter (`nqfjax.AbstractProgressMeter`) over the
      chunks, whose status also says when it is tracing, reading the checkpoint
      or compiling; `True` (default) for a `tqdm` bar, `False` for none, a string
      for a `tqdm` bar with that label. Only process 0 shows it.
    - `tag`: optional string mixed into the checkpoint fingerprint.

    **Returns:** a `SweepResult` with `.grid` and `.outputs` (leading axis `N`).

    **Raises:** `ValueError` for an empty grid, a non-numeric or non-finite grid
    array, arrays of different lengths, a bad `chunk`, a mesh without the axis
    `axis_name`, processes called differently, or a checkpoint that belongs to a
    different sweep or cannot be read or written (the file named);
    `KeyboardInterrupt` after a SIGINT, at a chunk boundary; `SweepPointError`
    when a runtime check failed at a point.
    """
    grid, n = _check_grid(grid)
    if chunk is None:
        chunk = n
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"`chunk` must be a positive integer, got {chunk!r}.")
    chunk = int(min(chunk, n))
    n_chunks = -(-n // chunk)
    n_dev, sharding, multi = _check_mesh(mesh, axis_name)
    padded = -(-chunk // n_dev) * n_dev

    def rows(i: int) -> int:
        """Number of real (unpadded) points in chunk `i`."""
        return min((i + 1) * chunk, n) - i * chunk

    def chunk_inputs(i: int) -> dict[str, Any]:
        idx = np.arange(i * chunk, i * chunk + padded)
        idx = np.minimum(idx, i * chunk + rows(i) - 1)  # pad: repeat the last point
        host = {name: a[idx] for name, a in grid.items()}
        if sharding is None:
            return {name: jnp.asarray(a) for name, a in host.items()}
        return {
            name: jax.make_array_from_callback(a.shape, sharding, lambda s, a=a: a[s])
            for name, a in host.items()
        }

    if isinstance(progress, str):  # a label for the default meter
        meter = as_progress_meter(bool(progress))
        label = progress
    else:
        meter, label = as_progress_meter(progress), "sweep"
    if jax.process_index() != 0:
        meter = NoProgressMeter()
    bar = meter.bar(n_chunks, label, unit="chunk")
    with defer_interrupts() as interrupted, bar:
        bar.status("tracing")
        program = _chunk_program(fn, chunk_inputs(0), mesh, axis_name)
        leaf_info = jax.tree.leaves(program.out_info)

        def expected(i: int):
            return [((rows(i), *s.shape[1:]), np.dtype(s.dtype)) for s in leaf_info]

        fingerprint = _fingerprint(fn, grid, chunk, program.out_info, tag)
        if multi:
            agree(fingerprint, mesh)
        ckpt = None
        if checkpoint is not None:
            meta = {
                "format": _FORMAT,
                "fn": _fn_name(fn),
                "tag": tag,
                "names": list(grid),
                "n_points": n,
                "chunk": chunk,
                "n_chunks": n_chunks,
            }
            writer = not multi or jax.process_index() == 0
            ckpt = Checkpoint(checkpoint, fingerprint, meta, writer=writer)
        if multi or ckpt is not None:
            bar.status("reading the checkpoint")
        if multi:
            results, damaged = sync_chunks(ckpt, n_chunks, expected)
        elif ckpt is not None:
            done, damaged = load_chunks(ckpt, expected)
            results = {i: leaves for i, (_, leaves) in done.items()}
        else:
            results, damaged = {}, []
        n_loaded = len(results)
        bar.update(n_loaded)
        todo = [i for i in range(n_chunks) if i not in results]
        out_leaves = []
        if todo:
            bar.status("compiling")
            compiled = program.compiled()
        bar.status("")
        for i in todo:
            if any_process(interrupted(), multi):
                raise KeyboardInterrupt
            # the runtime checks of the library's functions are recorded, not
            # raised, on the devices, and raised here once the chunk is done
            with deferred_errors() as failed:
                out_leaves = jax.tree.leaves(compiled(chunk_inputs(i)))
                leaves = [_to_host(x)[: rows(i)] for x in out_leaves]
            if any_process(bool(failed), multi):
                raise _point_error(failed, i, rows(i), chunk, grid, ckpt)
            if ckpt is not None and ckpt.writer:
                ckpt.write(i, serialise(leaves))
            results[i] = leaves
            bar.update(1)

    devices, shard_size = _shard_devices(out_leaves[0]) if out_leaves else ((), 0)
    flat = [
        jnp.asarray(np.concatenate([results[i][j] for i in range(n_chunks)], axis=0))
        for j in range(len(leaf_info))
    ]
    return SweepResult(
        grid={name: jnp.asarray(a) for name, a in grid.items()},
        outputs=jax.tree.unflatten(jax.tree.structure(program.out_info), flat),
        n_chunks=n_chunks,
        n_computed=len(todo),
        n_loaded=n_loaded,
        devices=devices,
        shard_size=shard_size,
        damaged=tuple(damaged),
        per_device=program.per_device,
    )
