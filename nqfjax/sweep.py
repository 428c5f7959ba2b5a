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

import hashlib
import json
import os
import weakref
from collections.abc import Callable, Mapping
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
from ._interrupts import defer_interrupts as defer_interrupts
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
    chunks, optionally sharded over devices and processes, and checkpointed (the
    how-to on sweeps shows them at work).

    The grid is *zipped*: `grid = {name: values}`, every `values` of the same
    leading length `N`, and point `i` is the call `fn(**{name: values[i]})`
    (`grid_product` builds a Cartesian product). `fn` must be traceable and
    return a pytree of arrays; close over what is not swept. Every chunk is
    padded to the same shape (by repeating its last point), so `fn` compiles
    once, and the program is kept (while `fn` lives) for later calls with the
    same `fn`, grid shapes and dtypes, mesh and `jax_enable_x64`. Like
    `jax.jit` it keys on the identity of `fn`: arrays `fn` closes over are
    constants of the program, so change `fn` (not the arrays) to change them.

    **Devices and processes.** With `mesh`, each chunk is split over the devices
    along `axis_name`, each running its own points' loops (`jax.shard_map`), or
    in lockstep as a sharded `jit` where `fn` cannot be traced so (diffrax's
    implicit solvers; `SweepResult.per_device`). Over several processes call
    `sweep` identically in each: process 0 alone reads and writes the
    checkpoint, and every process gets all results (and the progress on 0).

    **Runtime checks.** A library function's value checks (a negative init
    scale, a solve out of steps) are recorded on the devices and raised after
    the chunk as a `SweepPointError` naming the check and the chunk's points
    (the chunks before it are saved). Pass `throw=False` to a solver to get its
    result code as an output instead.

    **Checkpointing.** With `checkpoint=path` (a folder), each finished chunk is
    written atomically, then entered with its size and SHA-256 in a manifest
    holding the sweep's fingerprint (function name, `tag`, grid, chunk size,
    output structure; not the *body* of `fn`: change `tag` when it changes). A
    restarted sweep loads the chunks that match and computes the rest: a
    damaged one is named in a `UserWarning` (and `damaged`), one the manifest
    lacks is never loaded, another sweep's folder raises `ValueError`.

    **Interrupting.** A SIGINT (Ctrl-C) stops the sweep with `KeyboardInterrupt`
    once the chunk in progress is saved (a second one stops at once). `sweep` is
    a host-level driver, not differentiable or jit-able; `fn` may use `jax.grad`.

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
      chunks, its status saying what is being done; `True` (default) for a
      `tqdm` bar, `False` for none, a string for a `tqdm` bar with that label.
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
    chunks = _Chunks(grid, n, _check_chunk(chunk, n), *_check_mesh(mesh, axis_name))
    bar = _open_bar(progress, chunks.n_chunks)
    with defer_interrupts() as interrupted, bar:
        bar.status("tracing")
        program = _chunk_program(fn, chunks.inputs(0), mesh, axis_name)
        fingerprint = _fingerprint(fn, grid, chunks.chunk, program.out_info, tag)
        if chunks.multi:
            agree(fingerprint, mesh)
        ckpt = _open_checkpoint(checkpoint, fn, tag, chunks, fingerprint)
        results, damaged = _finished_chunks(ckpt, chunks, program.out_info, bar)
        todo = [i for i in range(chunks.n_chunks) if i not in results]
        last = _run_chunks(program, todo, chunks, ckpt, results, bar, interrupted)
    devices, shard_size = _shard_devices(last[0]) if last else ((), 0)
    return SweepResult(
        grid={name: jnp.asarray(a) for name, a in grid.items()},
        outputs=_join_chunks(results, program.out_info),
        n_chunks=chunks.n_chunks,
        n_computed=len(todo),
        n_loaded=chunks.n_chunks - len(todo),
        devices=devices,
        shard_size=shard_size,
        damaged=tuple(damaged),
        per_device=program.per_device,
    )


def _check_chunk(chunk, n: int) -> int:
    """Points per chunk: `chunk` (default: all `n`), at most `n`."""
    if chunk is None:
        chunk = n
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"`chunk` must be a positive integer, got {chunk!r}.")
    return int(min(chunk, n))


class _Chunks:
    """How the `n` grid points are cut: `chunk` points per chunk, each padded to
    `padded` (a multiple of the `n_dev` devices along the sweep axis) by
    repeating its last point, placed with `sharding` (`None`: no mesh); `multi`:
    whether the mesh spans several processes."""

    def __init__(self, grid, n, chunk, n_dev, sharding, multi):
        self.grid, self.n, self.chunk = grid, n, chunk
        self.n_chunks = -(-n // chunk)
        self.padded = -(-chunk // n_dev) * n_dev
        self.sharding, self.multi = sharding, multi

    def rows(self, i: int) -> int:
        """Number of real (unpadded) points in chunk `i`."""
        return min((i + 1) * self.chunk, self.n) - i * self.chunk

    def inputs(self, i: int) -> dict[str, Any]:
        """Chunk `i`'s padded grid points, on the devices."""
        start = i * self.chunk
        idx = np.arange(start, start + self.padded)
        idx = np.minimum(idx, start + self.rows(i) - 1)  # pad: repeat the last point
        host = {name: a[idx] for name, a in self.grid.items()}
        if self.sharding is None:
            return {name: jnp.asarray(a) for name, a in host.items()}
        return {
            name: jax.make_array_from_callback(
                a.shape, self.sharding, lambda s, a=a: a[s]
            )
            for name, a in host.items()
        }


def _open_bar(progress, n_chunks: int):
    """The progress bar over the chunks (shown by process 0 only)."""
    if isinstance(progress, str):  # a label for the default meter
        meter = as_progress_meter(bool(progress))
        label = progress
    else:
        meter, label = as_progress_meter(progress), "sweep"
    if jax.process_index() != 0:
        meter = NoProgressMeter()
    return meter.bar(n_chunks, label, unit="chunk")


def _open_checkpoint(checkpoint, fn, tag, chunks: _Chunks, fingerprint: str):
    """The sweep's `Checkpoint` (`None` without a folder); only process 0 of a
    multi-process sweep writes."""
    if checkpoint is None:
        return None
    meta = {
        "format": _FORMAT,
        "fn": _fn_name(fn),
        "tag": tag,
        "names": list(chunks.grid),
        "n_points": chunks.n,
        "chunk": chunks.chunk,
        "n_chunks": chunks.n_chunks,
    }
    writer = not chunks.multi or jax.process_index() == 0
    return Checkpoint(checkpoint, fingerprint, meta, writer=writer)


def _finished_chunks(ckpt, chunks: _Chunks, out_info, bar) -> tuple[dict, list]:
    """The chunks already done, `{i: leaves}` (read from the checkpoint; over
    several processes, as process 0 read them), counted on `bar`, and the
    damaged chunk files."""
    leaf_info = jax.tree.leaves(out_info)

    def expected(i: int):
        rows = chunks.rows(i)
        return [((rows, *s.shape[1:]), np.dtype(s.dtype)) for s in leaf_info]

    if chunks.multi or ckpt is not None:
        bar.status("reading the checkpoint")
    if chunks.multi:
        results, damaged = sync_chunks(ckpt, chunks.n_chunks, expected)
    elif ckpt is not None:
        done, damaged = load_chunks(ckpt, expected)
        results = {i: leaves for i, (_, leaves) in done.items()}
    else:
        results, damaged = {}, []
    bar.update(len(results))
    return results, damaged


def _run_chunks(program, todo, chunks: _Chunks, ckpt, results, bar, interrupted):
    """Compile `program` if a chunk is to do, and compute the chunks `todo` into
    `results` (`i -> leaves` on the host), each saved to the checkpoint when it
    is done; stop at a chunk boundary after a SIGINT. Returns the last chunk's
    output leaves on the devices."""
    if todo:
        bar.status("compiling")
        compiled = program.compiled()
    bar.status("")
    out_leaves = []
    for i in todo:
        if any_process(interrupted(), chunks.multi):
            raise KeyboardInterrupt
        # the runtime checks of the library's functions are recorded, not
        # raised, on the devices, and raised here once the chunk is done
        with deferred_errors() as failed:
            out_leaves = jax.tree.leaves(compiled(chunks.inputs(i)))
            leaves = [_to_host(x)[: chunks.rows(i)] for x in out_leaves]
        if any_process(bool(failed), chunks.multi):
            raise _point_error(
                failed, i, chunks.rows(i), chunks.chunk, chunks.grid, ckpt
            )
        if ckpt is not None and ckpt.writer:
            ckpt.write(i, serialise(leaves))
        results[i] = leaves
        bar.update(1)
    return out_leaves


def _join_chunks(results: dict, out_info) -> PyTree:
    """The chunks' leaves concatenated along the sweep axis, as `fn`'s pytree."""
    n_leaves = len(jax.tree.leaves(out_info))
    flat = [
        jnp.asarray(np.concatenate([results[i][j] for i in sorted(results)], axis=0))
        for j in range(n_leaves)
    ]
    return jax.tree.unflatten(jax.tree.structure(out_info), flat)
