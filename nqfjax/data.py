r"""Real data sets that ship with installable packages, ready for `predict`/`train`.

`load_dataset(name)` returns `(xs, ys)` from scikit-learn's bundled sets
(`"digits"`, `"wine"`, `"breast_cancer"`, `"iris"`, `"diabetes"`; read from the
package, never downloaded) or MNIST-1D generated locally by the `mnist1d`
package (`"mnist1d"`: its `make_dataset` builds the signals from the package's
templates; nothing is fetched). Both libraries are the optional extra
`nqfjax[data]`.

The inputs are standardised (each feature zero mean, unit variance over the
returned samples), and deliberately *not* whitened: real input covariances do
not share an eigenbasis with the input-output correlation, which is what the
predictions here must cope with. `whiten=True` whitens them (then the tasks of
a perceptron reduce exactly to a Lotka-Volterra system).
"""

import lzma
import math
import os
import random
import tokenize
import warnings
import zipfile
import zlib
from typing import Literal

import numpy as np


#: The names `load_dataset` accepts, with (samples, features, classes) of the
#: full set (`classes = 0`: a regression target).
DATASETS: dict[str, tuple[int, int, int]] = {
    "digits": (1797, 64, 10),
    "wine": (178, 13, 3),
    "breast_cancer": (569, 30, 2),
    "iris": (150, 4, 3),
    "diabetes": (442, 10, 0),
    "mnist1d": (5000, 40, 10),
}

_TARGETS = ("onehot", "label")


def _sklearn(name: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        import sklearn.datasets  # optional extra: nqfjax[data]
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"The {name!r} data set needs scikit-learn: pip install 'nqfjax[data]'."
        ) from e
    bunch = getattr(sklearn.datasets, f"load_{name}")()
    return np.asarray(bunch.data, np.float64), np.asarray(bunch.target)


def _mnist1d(num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`num_samples` MNIST-1D signals (length 40) and labels, generated locally
    by `mnist1d.data.make_dataset` with the package's default arguments and
    `seed`. `make_dataset` seeds the global `random`/`numpy.random` generators;
    their states are restored afterwards."""
    try:
        import mnist1d.data  # optional extra: nqfjax[data]
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The 'mnist1d' data set needs the mnist1d package: "
            "pip install 'nqfjax[data]'."
        ) from e
    args = mnist1d.data.get_dataset_args()
    # make_dataset draws num_samples // 10 signals per class; round up
    args.num_samples = 10 * -(-num_samples // 10)
    args.seed = int(seed)
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = mnist1d.data.make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    xs = np.concatenate([data["x"], data["x_test"]])[:num_samples]
    ys = np.concatenate([data["y"], data["y_test"]])[:num_samples]
    return np.asarray(xs, np.float64), np.asarray(ys)


def _check_int(name: str, value, minimum: int, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value}.")
    return int(value)


def _whiten(xs: np.ndarray) -> np.ndarray:
    """ZCA whitening of centred `xs`: covariance the identity on the span of the
    data (a projector where features are collinear: eigenvalues below
    `1e-10` of the largest are dropped rather than amplified)."""
    cov = xs.T @ xs / xs.shape[0]
    w, V = np.linalg.eigh(cov)
    keep = w > 1e-10 * w.max()
    inv_sqrt = np.where(keep, 1.0 / np.sqrt(np.where(keep, w, 1.0)), 0.0)
    return xs @ (V * inv_sqrt) @ V.T


def load_dataset(
    name: str,
    *,
    n: int | None = None,
    seed: int = 0,
    target: Literal["onehot", "label"] = "onehot",
    whiten: bool = False,
    pca: int | None = None,
    dtype=np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    r"""A real data set as `(xs, ys)`, standardised but not whitened.

    **Inputs.** With `n` samples kept (a random subset drawn with `seed` when
    `n` is smaller than the set), each feature is centred and scaled to unit
    variance over those samples: `xs.mean(0) == 0`, `xs.std(0) == 1`. Features
    that are constant over the samples (digits' border pixels) are dropped, so
    `xs` may have fewer columns than `DATASETS` lists. With `pca = q` the
    standardised inputs are projected on their `q` leading principal directions
    (scores, variances kept: the covariance is `diag(variances)`, not the
    identity) to keep `p` small. With `whiten=True` the covariance becomes the
    identity (ZCA; after `pca`, the scores are scaled to unit variance).

    **Targets.** `target="onehot"`: one column per class, the one-hot code minus
    the class frequencies, so each column is centred, shape `(n, classes)` (the
    columns sum to zero: `classes - 1` independent directions). `target="label"`:
    one column, the class index (or, for `"diabetes"`, the regression target)
    centred and scaled to unit variance, shape `(n, 1)`. `"diabetes"` only has
    the latter.

    **Arguments:**

    - `name`: one of `DATASETS`: `"digits"`, `"wine"`, `"breast_cancer"`,
      `"iris"`, `"diabetes"` (scikit-learn's bundled sets) or `"mnist1d"`
      (generated locally, 5000 signals unless `n` says otherwise).
    - `n`: at most this many samples (default: all).
    - `seed`: seed of the subset (and of MNIST-1D's generator).
    - `target`: `"onehot"` or `"label"`.
    - `whiten`: whiten the inputs (default `False`).
    - `pca`: keep this many leading principal components (default: all features).
    - `dtype`: a floating dtype of the returned arrays (default `float32`).

    **Returns:** `(xs, ys)`, numpy arrays of shapes `(n, d)` and `(n, k)`.

    **Raises:** `ValueError` naming the argument for an unknown `name` or
    `target`, `n`/`seed`/`pca` that are not integers in range, a non-floating
    `dtype`; `ImportError` when the extra `nqfjax[data]` is not installed.
    """
    n, seed, pca, dtype = _check_load_args(name, n, seed, target, whiten, pca, dtype)
    xs, labels = _samples(name, n, seed)
    xs = _standardised(xs, name, pca, whiten)
    return xs.astype(dtype), _targets(labels, name, target).astype(dtype)


def _check_load_args(name, n, seed, target, whiten, pca, dtype):
    """`load_dataset`'s arguments checked (a `ValueError` naming the bad one):
    `(n, seed, pca, dtype)`."""
    if name not in DATASETS:
        raise ValueError(f"`name` must be one of {sorted(DATASETS)}, got {name!r}.")
    if target not in _TARGETS:
        raise ValueError(f"`target` must be one of {_TARGETS}, got {target!r}.")
    if name == "diabetes" and target != "label":
        raise ValueError(
            "`target` must be 'label' for 'diabetes' (a regression target)."
        )
    n = _check_int("n", n, 2, allow_none=True)
    seed = _check_int("seed", seed, 0)
    pca = _check_int("pca", pca, 1, allow_none=True)
    if not isinstance(whiten, bool):
        raise ValueError(f"`whiten` must be True or False, got {whiten!r}.")
    try:
        dtype = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"`dtype` must be a floating dtype, got {dtype!r}.") from e
    if not np.issubdtype(dtype, np.floating):
        raise ValueError(f"`dtype` must be a floating dtype, got {dtype}.")
    return n, seed, pca, dtype


def _samples(name: str, n: int | None, seed: int):
    """`(xs, labels)`: the set's samples, at most `n` (a subset drawn with
    `seed`)."""
    total = DATASETS[name][0]
    if name == "mnist1d":
        return _mnist1d(total if n is None else n, seed)
    xs, labels = _sklearn(name)
    if n is not None and n < total:
        keep = np.sort(np.random.default_rng(seed).permutation(total)[:n])
        xs, labels = xs[keep], labels[keep]
    return xs, labels


def _standardised(xs, name: str, pca: int | None, whiten: bool) -> np.ndarray:
    """The inputs centred and scaled to unit variance, constant features
    dropped; then projected on `pca` principal directions, and whitened."""
    xs = xs - xs.mean(0)
    std = xs.std(0)
    xs = xs[:, std > 1e-12 * max(std.max(), 1e-300)]
    xs = xs / xs.std(0)
    if pca is not None:
        if pca > xs.shape[1]:
            raise ValueError(
                f"`pca` must be at most the {xs.shape[1]} non-constant features of "
                f"{name!r}, got {pca}."
            )
        _, _, Vt = np.linalg.svd(xs, full_matrices=False)
        xs = xs @ Vt[:pca].T
    if whiten:
        xs = _whiten(xs)
    return xs


def _targets(labels, name: str, target: str) -> np.ndarray:
    """The centred one-hot codes (`"onehot"`, a column per class of the set) or
    the standardised label (`"label"`), shape `(n, k)`."""
    if target == "onehot":
        # every class of the set gets a column, also one absent from a subset
        classes = np.arange(DATASETS[name][2])
        ys = (labels[:, None] == classes[None, :]).astype(np.float64)
    else:
        ys = labels.astype(np.float64)[:, None]
    ys = ys - ys.mean(0)
    if target == "label":
        ys = ys / ys.std(0)
    return ys


# --------------------------------------------------------------------------------
# a user's own data file


def _is_target_column(name: str) -> bool:
    name = name.strip().lower()
    return name == "y" or (
        name.startswith("y") and (name[1:].isdigit() or name[1:2] == "_")
    )


# How reading a damaged or hostile zip archive fails: `zipfile` raises
# `BadZipFile` for a truncated or corrupt archive or a bad CRC, `EOFError` when
# a member's data end early, `NotImplementedError` for an unknown compression
# method and `RuntimeError` for an encrypted member; the decompressors raise
# their own errors; `ValueError` for a bad member name or .npy header.
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zlib.error,
    lzma.LZMAError,
    EOFError,
    OSError,
    NotImplementedError,
    RuntimeError,
    ValueError,
)


class _BadArray(ValueError):
    """An archive that is read but holds an array nqfjax refuses."""


def _read_npy(archive: zipfile.ZipFile, key: str) -> np.ndarray:
    """The array `key` of an open .npz archive, its .npy header checked before
    any data are read: real numbers only (an object array is refused: its
    pickle is never loaded), and as many bytes as the header's shape needs (a
    header that claims a huge shape allocates nothing)."""
    info = archive.getinfo(f"{key}.npy")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        read_header = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }.get(version)
        if read_header is None:  # 3.0 is for unicode field names: not numbers
            raise _BadArray(f"`{key}`: unsupported .npy format version {version}.")
        try:
            # the header (at most 10000 characters) is a Python literal, read
            # with `ast.literal_eval` and, failing that, `tokenize` (a header
            # written by Python 2: read with a UserWarning, silenced); a
            # hostile one makes them raise these
            with warnings.catch_warnings(action="ignore", category=UserWarning):
                shape, fortran_order, dtype = read_header(f)
        except (TypeError, RecursionError, MemoryError, tokenize.TokenError) as e:
            raise _BadArray(
                f"`{key}`: unreadable .npy header ({type(e).__name__})."
            ) from None
        if dtype.hasobject:
            raise _BadArray(
                f"`{key}` holds Python objects (pickled data, which nqfjax never "
                "loads); save arrays of numbers."
            )
        if dtype.kind not in "biuf":
            raise _BadArray(f"`{key}` must hold real numbers, got dtype {dtype}.")
        if any(size < 0 for size in shape):
            raise _BadArray(f"`{key}`: its header gives a negative size {shape}.")
        nbytes = math.prod(shape) * dtype.itemsize
        stored = info.file_size - f.tell()
        if nbytes != stored:
            raise _BadArray(
                f"`{key}`: its header gives shape {shape} of {dtype} ({nbytes} "
                f"bytes) but the archive holds {stored} bytes of data."
            )
        data = f.read(nbytes)
        if len(data) != nbytes:  # the archive ended early (also a bad CRC)
            raise EOFError(f"`{key}` ends after {len(data)} of its {nbytes} bytes")
    order = "F" if fortran_order else "C"
    return np.frombuffer(data, dtype).reshape(shape, order=order)


def _read_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    # read with `zipfile` and numpy's .npy header parser rather than `np.load`:
    # every failure of a damaged, truncated or hostile file is caught here, and
    # nothing is allocated or unpickled before the header is checked
    try:
        with zipfile.ZipFile(path) as archive:
            found = sorted(
                name.removesuffix(".npy")
                for name in archive.namelist()
                if name.endswith(".npy")
            )
            missing = [key for key in ("xs", "ys") if key not in found]
            if missing:
                raise _BadArray(
                    f"missing array {missing[0]!r} (found "
                    f"{', '.join(map(repr, found)) or 'none'}); save the data "
                    "with numpy.savez(path, xs=inputs, ys=targets)."
                )
            xs, ys = (_read_npy(archive, key) for key in ("xs", "ys"))
    except _BadArray as e:
        raise ValueError(f"{path}: {e}") from None
    except _ZIP_ERRORS as e:
        message = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(
            f"{path}: not a readable .npz file (numpy.savez's zip of arrays): "
            f"{message}."
        ) from None
    return xs, ys


def _read_csv(path: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not a UTF-8 text (CSV) file (byte {e.start}: "
            f"{e.object[e.start : e.start + 1]!r})."
        ) from None
    lines = [
        (i + 1, line)
        for i, line in enumerate(text.splitlines())
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise ValueError(f"{path}: empty file (a header line, then one row each).")
    header = [name.strip() for name in lines[0][1].split(",")]
    is_y = np.array([_is_target_column(name) for name in header])
    if not is_y.any() or is_y.all():
        raise ValueError(
            f"{path}: the header must name feature columns and target columns "
            f"(targets: 'y', 'y0', 'y1', ... or 'y_...'), got {header}."
        )
    rows = []
    for lineno, line in lines[1:]:
        cells = line.split(",")
        if len(cells) != len(header):
            raise ValueError(
                f"{path}: line {lineno} has {len(cells)} columns, the header "
                f"{len(header)}."
            )
        row = []
        for cell in cells:
            try:
                row.append(float(cell))
            except ValueError:
                shown = repr(cell) if len(cell) <= 40 else f"{cell[:40]!r}..."
                raise ValueError(
                    f"{path}: line {lineno}: not a number ({shown})."
                ) from None
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no data rows after the header.")
    table = np.asarray(rows, np.float64)
    return table[:, ~is_y], table[:, is_y]


def load_data_file(path, *, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    r"""A user's data `(xs, ys)` from a `.npz` or `.csv` file, checked.

    - `.npz`: the arrays `xs` (shape `(n, ...)`, e.g. `(n, d)` or `(n, T, d)`) and
      `ys` (shape `(n, k)`, or `(n,)` for one output), as written by
      `numpy.savez(path, xs=..., ys=...)`.
    - `.csv`: a header line, then one row per sample; the columns named `y`,
      `y0`, `y1`, ... or `y_<name>` are the targets, the others the features.
      Blank lines and lines starting with `#` are skipped.

    The data are returned as they are (no standardisation).

    **Arguments:**

    - `path`: the file.
    - `dtype`: a floating dtype of the returned arrays (default `float32`).

    **Returns:** `(xs, ys)` with `ys` of shape `(n, k)`.

    **Raises:** `ValueError`, one line starting with the path, for a missing
    or unreadable file, an unknown suffix, a damaged or truncated `.npz`, a
    missing array, an array of anything but real numbers (an object array's
    pickle is never loaded), an empty array, NaN or inf or a number too large
    for `dtype` (naming the array and the first row), `xs` and `ys` with
    different numbers of rows, fewer than two samples, a CSV file that is not
    UTF-8, or a malformed CSV line.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{path}: a folder, not a data file.")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file.")
    suffix = os.path.splitext(path)[1].lower()
    try:
        if suffix == ".npz":
            xs, ys = _read_npz(path)
        elif suffix == ".csv":
            xs, ys = _read_csv(path)
        else:
            raise ValueError(f"{path}: the data file must end in .npz or .csv.")
    except OSError as e:  # not readable (permissions, a device, ...)
        raise ValueError(f"{path}: cannot be read ({e.strerror or e}).") from None
    if xs.ndim < 2:
        raise ValueError(
            f"{path}: `xs` must have shape (n, features...), got {xs.shape}."
        )
    if ys.ndim == 1:
        ys = ys[:, None]
    if ys.ndim != 2:
        raise ValueError(
            f"{path}: `ys` must have shape (n, k) or (n,), got {ys.shape}."
        )
    if xs.shape[0] != ys.shape[0]:
        raise ValueError(
            f"{path}: `xs` has {xs.shape[0]} rows but `ys` has {ys.shape[0]}; "
            "they must hold one row per sample."
        )
    if xs.shape[0] < 2:
        raise ValueError(f"{path}: at least 2 samples are needed, got {xs.shape[0]}.")
    dtype = np.dtype(dtype)
    out = []
    for key, array in (("xs", xs), ("ys", ys)):
        if 0 in array.shape:
            raise ValueError(f"{path}: `{key}` is empty, shape {array.shape}.")
        rows = array.reshape(len(array), -1)
        with np.errstate(over="ignore"):
            cast = rows.astype(dtype)
        # NaN or inf in the file, or a finite number beyond `dtype`'s range
        for bad, what in (
            (~np.isfinite(rows), "contains NaN or inf"),
            (~np.isfinite(cast), f"holds a number too large for {dtype}"),
        ):
            if bad.any():
                row = int(np.flatnonzero(bad.any(axis=1))[0])
                raise ValueError(f"{path}: `{key}` {what} (first at row {row}).")
        out.append(cast.reshape(array.shape))
    return out[0], out[1]
