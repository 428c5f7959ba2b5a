"""jit + vmap sweeps over hyperparameter grids, sharded over devices, checkpointed.

One compiled, vmapped call per chunk of grid points; with a `jax.sharding.Mesh` the
chunk is split along the sweep axis over every device of a named mesh axis; with a
checkpoint directory each finished chunk is written atomically and a restarted
sweep resumes where it stopped.
"""

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree
from tqdm import tqdm

from .io import atomic_write


_MANIFEST = "manifest.json"


_MANIFEST = "manifest.json"
_CHUNK_RE = re.compile(r"^chunk_(\d{6})\.npz$")


_CHUNK_RE = re.compile(r"^chunk_(\d{6})\.npz$")
_FORMAT = 1


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
      computed chunk (ordered by shard); empty if nothing was computed.
    - `shard_size`: points of the (padded) chunk held by each of those devices.
    """

    grid: dict[str, Array]
    outputs: PyTree
    n_chunks: int = eqx.field(static=True)
    n_computed: int = eqx.field(static=True)
    n_loaded: int = eqx.field(static=True)
    devices: tuple[int, ...] = eqx.field(static=True, default=())
    shard_size: int = eqx.field(static=True, default=0)

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


def _open_checkpoint(path: str, fingerprint: str, meta: dict) -> set[int]:
    """Create or validate the checkpoint directory; return the finished chunks."""
    os.makedirs(path, exist_ok=True)
    manifest = os.path.join(path, _MANIFEST)
    if os.path.exists(manifest):
        with open(manifest) as f:
            try:
                old = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"checkpoint manifest {manifest} is corrupt.") from e
        if old.get("fingerprint") != fingerprint:
            diff = {
                k: (old.get(k), meta[k]) for k in meta if old.get(k) != meta[k]
            } or "the grid values or the output structure"
            raise ValueError(
                f"checkpoint {path!r} belongs to a different sweep (fingerprint "
                f"mismatch; differs in {diff}). Use a fresh directory, or delete it "
                "to start over."
            )
    elif jax.process_index() == 0:
        payload = json.dumps({"fingerprint": fingerprint, **meta}, indent=1).encode()
        atomic_write(manifest, lambda f: f.write(payload))
    done = set()
    for entry in os.listdir(path):
        match = _CHUNK_RE.match(entry)
        if match and int(match.group(1)) < meta["n_chunks"]:
            done.add(int(match.group(1)))
        elif ".tmp-" in entry and jax.process_index() == 0:
            # a partial write from a killed run: never a finished chunk
            try:
                os.remove(os.path.join(path, entry))
            except FileNotFoundError:
                pass
    return done


def _chunk_file(path: str, i: int) -> str:
    return os.path.join(path, f"chunk_{i:06d}.npz")


def _to_host(x) -> np.ndarray:
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def sweep(
    fn: Callable[..., PyTree],
    grid: Mapping[str, Any],
    mesh: Mesh | None = None,
    checkpoint: str | os.PathLike | None = None,
    chunk: int | None = None,
    *,
    axis_name: str = "sweep",
    progress: bool = True,
    tag: str | None = None,
) -> SweepResult:
    r"""Run `fn` at every point of a hyperparameter grid: jit-compiled, vmapped, in
    chunks, optionally sharded over devices and checkpointed.

    The grid is a *zipped* list of points: `grid = {name: values}` with every
    `values` of the same leading length `N`, and point `i` is the keyword call
    `fn(**{name: values[i]})`. Build a Cartesian product with `grid_product`. `fn`
    must be traceable (`jax.jit(jax.vmap(...))` is applied to it) and return a
    pytree of arrays; close over everything that is not swept (`functools.partial`
    or a closure). Anything that branches on a swept value in Python (a batch
    size, a number of steps) cannot be swept this way.

    The points are processed in chunks of `chunk` points. Every chunk is padded to
    the same shape (the last one by repeating its last point; padded results are
    dropped), so `fn` is traced and compiled exactly once per call.

    **Devices.** With `mesh`, the sweep axis of each chunk is sharded with
    `NamedSharding(mesh, PartitionSpec(axis_name))` over all devices along the mesh
    axis `axis_name` (replicated over any other mesh axes), and the chunk is padded
    to a multiple of their number. For one host with several devices,
    `Mesh(jax.devices(), ("sweep",))`. On several hosts, call
    `jax.distributed.initialize()` first in every process, build the mesh from the
    global `jax.devices()`, and call `sweep` with identical arguments in every
    process (SPMD): each process feeds its own shards
    (`jax.make_array_from_callback`), results are all-gathered to every process,
    and only process 0 writes checkpoint files (use a shared file system). For
    testing on CPU: `XLA_FLAGS=--xla_force_host_platform_device_count=8`.

    **Checkpointing.** With `checkpoint=path` (a directory), the directory holds a
    `manifest.json` (a fingerprint of the function name, `tag`, the grid names,
    dtypes and values, the chunk size and the output structure) and one
    `chunk_XXXXXX.npz` per finished chunk, each written to a temporary file and
    moved into place with `os.replace`, so a killed run leaves only whole chunks.
    A restarted sweep loads the finished chunks and computes only the rest; the
    chunk layout does not depend on the number of devices, so a sweep may be
    resumed on a different machine. A directory from a different sweep raises
    `ValueError`. The fingerprint cannot see a change in the *body* of `fn`:
    change `tag` (or the directory) when the function changes.

    **Gradients.** `fn` may itself use `jax.grad` (for example the gradient of a
    loss through `solve_lv` with respect to a hyperparameter, reverse mode with
    `diffrax.RecursiveCheckpointAdjoint`); `sweep` is a host-level driver and is
    not itself differentiable or jit-able.

    **Arguments:**

    - `fn`: the function of one grid point, called with the grid names as keyword
      arguments, returning a pytree of arrays.
    - `grid`: dict `name -> array` with a common leading length `N >= 1` (further
      axes are passed to `fn` per point); numeric, finite.
    - `mesh`: optional `jax.sharding.Mesh` with an axis called `axis_name`.
    - `checkpoint`: optional directory for resumable sweeps.
    - `chunk`: points per chunk (default: all `N` in one chunk).
    - `axis_name`: the mesh axis to shard the sweep over (default `"sweep"`).
    - `progress`: show a `tqdm` progress bar over chunks (default `True`).
    - `tag`: optional string mixed into the checkpoint fingerprint.

    **Returns:** a `SweepResult` with `.grid` and `.outputs` (leading axis `N`).

    **Raises:** `ValueError` for an empty grid, a non-numeric or non-finite grid
    array, arrays of different lengths, a bad `chunk`, a mesh without the axis
    `axis_name`, or a checkpoint from a different sweep.
    """
    grid, n = _check_grid(grid)
    if chunk is None:
        chunk = n
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"`chunk` must be a positive integer, got {chunk!r}.")
    chunk = int(min(chunk, n))
    n_chunks = -(-n // chunk)

    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise ValueError(f"`mesh` must be a jax.sharding.Mesh, got {type(mesh)}.")
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"`mesh` has no axis named {axis_name!r} (its axes are "
                f"{mesh.axis_names}); pass `axis_name=` one of them."
            )
        n_dev = int(mesh.shape[axis_name])
        sharding = NamedSharding(mesh, PartitionSpec(axis_name))
    else:
        n_dev = 1
        sharding = None
    padded = -(-chunk // n_dev) * n_dev

    def point_fn(point):
        return fn(**point)

    if sharding is None:
        batched = jax.jit(jax.vmap(point_fn))
    else:
        batched = jax.jit(
            jax.vmap(point_fn), in_shardings=(sharding,), out_shardings=sharding
        )

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

    # One trace, shared by the fingerprint (output structure) and the compile.
    traced = batched.trace(chunk_inputs(0))
    out_info = traced.out_info
    treedef = jax.tree.structure(out_info)
    leaf_info = jax.tree.leaves(out_info)

    done: set[int] = set()
    path = None
    if checkpoint is not None:
        path = os.fspath(checkpoint)
        meta = {
            "fn": _fn_name(fn),
            "tag": tag,
            "names": list(grid),
            "n_points": n,
            "chunk": chunk,
            "n_chunks": n_chunks,
        }
        fingerprint = _fingerprint(fn, grid, chunk, out_info, tag)
        done = _open_checkpoint(path, fingerprint, meta)

    results: dict[int, list[np.ndarray]] = {}
    for i in sorted(done):
        assert path is not None
        with np.load(_chunk_file(path, i)) as data:
            leaves = [data[f"leaf_{j}"] for j in range(len(leaf_info))]
        for leaf, info in zip(leaves, leaf_info):
            if leaf.shape != (rows(i), *info.shape[1:]):
                raise ValueError(
                    f"checkpoint chunk {_chunk_file(path, i)} does not match this "
                    f"sweep's outputs (shape {leaf.shape}, expected "
                    f"{(rows(i), *info.shape[1:])})."
                )
        results[i] = leaves

    todo = [i for i in range(n_chunks) if i not in done]
    devices: tuple[int, ...] = ()
    shard_size = 0
    if todo:
        compiled = traced.lower().compile()
        bar = tqdm(
            total=n_chunks,
            initial=len(done),
            desc="sweep",
            unit="chunk",
            disable=(not progress) or jax.process_index() != 0,
        )
        try:
            for i in todo:
                out = compiled(chunk_inputs(i))
                out_leaves = jax.tree.leaves(out)
                leaves = [_to_host(leaf)[: rows(i)] for leaf in out_leaves]
                if path is not None and jax.process_index() == 0:

                    def write(f, leaves=leaves):
                        np.savez(f, **{f"leaf_{j}": x for j, x in enumerate(leaves)})

                    atomic_write(_chunk_file(path, i), write)
                results[i] = leaves
                bar.update(1)
        finally:
            bar.close()
        if out_leaves:
            shards = sorted(
                out_leaves[0].addressable_shards,
                key=lambda s: (s.index[0].start or 0, s.device.id),
            )
            devices = tuple(dict.fromkeys(s.device.id for s in shards))
            shard_size = int(shards[0].data.shape[0])

    flat = [
        jnp.asarray(np.concatenate([results[i][j] for i in range(n_chunks)], axis=0))
        for j in range(len(leaf_info))
    ]
    return SweepResult(
        grid={name: jnp.asarray(a) for name, a in grid.items()},
        outputs=jax.tree.unflatten(treedef, flat),
        n_chunks=n_chunks,
        n_computed=len(todo),
        n_loaded=len(done),
        devices=devices,
        shard_size=shard_size,
    )
