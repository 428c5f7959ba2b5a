"""Files: output folders checked up front, one atomic writer, JSON with NaN as
`null`, figures, library versions.

Every file nqfjax writes (reports, figures, checkpoint chunks) goes through
`atomic_write`: a temporary file in the same folder, flushed and synced, then
`os.replace`d, so an interrupted run leaves either the old file or the new one,
never half of one. Every command checks its output folder with
`check_output_dir` before doing any work.
"""

import importlib.metadata
import json
import math
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np


_LIBRARIES = ("nqfjax", "jax", "jaxlib", "equinox", "diffrax", "optax", "numpy")


def check_output_dir(path: str | os.PathLike, name: str = "out_dir") -> Path:
    """Check that `path` is, or can be made, a folder nqfjax can write to, without
    creating anything: it is not a file, the nearest existing folder above it is a
    folder, and a probe folder can be made (and is removed) there.

    **Arguments:**

    - `path`: the output folder.
    - `name`: how error messages call it (e.g. `"--out"`).

    **Returns:** `path` as a `Path`.

    **Raises:** `ValueError` naming `name` and the path when the folder cannot be
    created or written (under a file, in a read-only or virtual file system such
    as `/proc`, or naming an existing file).
    """
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise ValueError(f"{name} {str(path)!r} exists and is not a folder.")
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"{name} {str(path)!r} cannot be created: {str(existing)!r} is not a "
            "folder."
        )
    try:  # the only sure test of "writable" (root passes os.access in /proc)
        os.rmdir(tempfile.mkdtemp(prefix=".nqfjax-probe-", dir=existing))
    except OSError as e:
        where = "written to" if existing == path else "created"
        raise ValueError(
            f"{name} {str(path)!r} cannot be {where}: making a folder in "
            f"{str(existing)!r} failed ({e.strerror or e})."
        ) from None
    return path


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """Call `write(f)` on a binary file object, then move it to `path` atomically."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    data = text.encode()
    atomic_write(path, lambda f: f.write(data))


def versions() -> dict[str, str]:
    """The Python and library versions and JAX's backend, for reports."""
    out = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover
            out[name] = "unknown"
    out["backend"] = jax.default_backend()
    return out


def jsonable(x):
    """Python floats for JSON, with NaN and inf as `null`."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray | jax.Array):
        return jsonable(np.asarray(x).tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(path: str | os.PathLike, obj) -> None:
    """`obj` as indented JSON (NaN and inf as `null`), written atomically."""
    text = json.dumps(jsonable(obj), indent=1, allow_nan=False).encode()
    atomic_write(path, lambda f: f.write(text))


def write_figure(path: str | os.PathLike, fig) -> None:
    """A matplotlib `Figure` as PNG (100 dpi), written atomically.

    zlib level 3 instead of Pillow's 6: the same pixels, files ~4% larger,
    encoded in ~60% of the time (~40 ms less on a 1250x1080 figure)."""
    atomic_write(
        path,
        lambda f: fig.savefig(
            f, format="png", dpi=100, pil_kwargs={"compress_level": 3}
        ),
    )
