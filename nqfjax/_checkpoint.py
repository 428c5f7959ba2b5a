"""A sweep's checkpoint folder: a manifest, and one verified file per chunk.

The folder holds `manifest.json` (the sweep's fingerprint, a description of the
sweep, and per finished chunk its file's size in bytes and SHA-256) and one
`chunk_XXXXXX.npz` per finished chunk. A chunk is written first (atomically),
then entered in the manifest (atomically), so a chunk file the manifest does not
list with the same size and hash -- a partial write, a chunk of another sweep left
behind after its manifest was deleted, a damaged file -- is never loaded: it is
recomputed and overwritten. Chunks are read with `np.load(allow_pickle=False)`
after their hash matched, and checked against the outputs' shapes and dtypes.
"""

import hashlib
import io
import json
import os
import re
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from .io import atomic_write


MANIFEST = "manifest.json"
_CHUNK_RE = re.compile(r"^chunk_(\d{6})\.npz$")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def serialise(leaves: Sequence[np.ndarray]) -> bytes:
    """The bytes of a chunk file: an uncompressed npz of `leaf_0`, `leaf_1`, ..."""
    buffer = io.BytesIO()
    np.savez(buffer, **{f"leaf_{j}": np.asarray(x) for j, x in enumerate(leaves)})
    return buffer.getvalue()


def parse(data: bytes, expected: Sequence[tuple[tuple[int, ...], np.dtype]]):
    """The leaves stored in `data`, or a string saying why they cannot be used."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            names = sorted(npz.files)
            wanted = sorted(f"leaf_{j}" for j in range(len(expected)))
            if names != wanted:
                return f"holds arrays {names}, expected {wanted}"
            leaves = [npz[f"leaf_{j}"] for j in range(len(expected))]
    except Exception as e:  # any unreadable content: zip, npy header, pickles
        return f"cannot be read ({type(e).__name__}: {e})"
    for j, (leaf, (shape, dtype)) in enumerate(zip(leaves, expected)):
        if leaf.shape != tuple(shape) or leaf.dtype != dtype:
            return (
                f"holds leaf {j} of shape {leaf.shape} and dtype {leaf.dtype}, "
                f"expected {tuple(shape)} and {np.dtype(dtype)}"
            )
    return leaves


class Checkpoint:
    """One sweep's checkpoint folder (see the module docstring).

    `writer=False` (the processes other than 0 of a multi-process sweep) never
    creates, changes or trusts anything in the folder: it only reads chunk files
    whose hash process 0 sent.
    """

    def __init__(self, path, fingerprint: str, meta: dict, writer: bool):
        self.path = os.fspath(path)
        self.fingerprint = fingerprint
        self.meta = meta
        self.writer = writer
        self.entries: dict[int, dict] = {}

    def chunk_file(self, i: int) -> str:
        return os.path.join(self.path, f"chunk_{i:06d}.npz")

    @property
    def manifest_file(self) -> str:
        return os.path.join(self.path, MANIFEST)

    def open(self) -> list[str]:
        """Validate or create the folder and its manifest; return the chunk files
        found without an entry in the manifest (they will be overwritten).

        Raises `ValueError` naming the file for a folder that is a file or cannot
        be created, an unreadable or corrupt manifest, or a manifest of another
        sweep.
        """
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"checkpoint {self.path!r} exists and is not a folder.")
        try:
            os.makedirs(self.path, exist_ok=True)
            names = os.listdir(self.path)
        except OSError as e:
            raise ValueError(
                f"cannot use checkpoint folder {self.path!r}: {e.strerror or e}."
            ) from None
        manifest = self.manifest_file
        if os.path.lexists(manifest):
            self.entries = self._read_manifest()
        else:
            self._write_manifest()
        for name in names:  # a partial write of a killed run is never a chunk
            if ".tmp-" in name:
                try:
                    os.remove(os.path.join(self.path, name))
                except OSError:
                    pass
        return sorted(
            self.chunk_file(int(m.group(1)))
            for m in map(_CHUNK_RE.match, names)
            if m and int(m.group(1)) not in self.entries
        )

    def _read_manifest(self) -> dict[int, dict]:
        manifest = self.manifest_file
        try:
            with open(manifest, "rb") as f:
                old = json.loads(f.read().decode())
        except OSError as e:
            raise ValueError(f"cannot read {manifest}: {e.strerror or e}.") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            old = None
        chunks = old.get("chunks") if isinstance(old, dict) else None
        if chunks is None and isinstance(old, dict) and "format" not in old:
            raise ValueError(
                f"checkpoint manifest {manifest} was written by an older nqfjax, "
                "without the chunks' hashes: delete the folder to start over."
            )
        entries = {}
        if isinstance(chunks, dict):
            for key, entry in chunks.items():
                if (
                    not (isinstance(key, str) and key.isdigit())
                    or not isinstance(entry, dict)
                    or type(entry.get("size")) is not int
                    or entry["size"] < 0
                    or not isinstance(entry.get("sha256"), str)
                ):
                    chunks = None
                    break
                entries[int(key)] = entry
        if chunks is None or not isinstance(old.get("fingerprint"), str):
            raise ValueError(
                f"checkpoint manifest {manifest} is corrupt: it cannot say which "
                "sweep the folder belongs to. Delete the folder to start over."
            )
        if old["fingerprint"] != self.fingerprint:
            diff = {
                k: (old.get(k), v) for k, v in self.meta.items() if old.get(k) != v
            } or "the grid values or the output structure"
            raise ValueError(
                f"checkpoint {self.path!r} belongs to a different sweep (fingerprint "
                f"mismatch; differs in {diff}). Use a fresh folder, or delete it "
                "to start over."
            )
        return {i: e for i, e in entries.items() if i < self.meta["n_chunks"]}

    def _write_manifest(self) -> None:
        chunks = {f"{i:06d}": self.entries[i] for i in sorted(self.entries)}
        payload = {"fingerprint": self.fingerprint, **self.meta, "chunks": chunks}
        data = json.dumps(payload, indent=1).encode()
        try:
            atomic_write(self.manifest_file, lambda f: f.write(data))
        except OSError as e:
            raise ValueError(
                f"cannot write {self.manifest_file}: {e.strerror or e}."
            ) from None

    def read(self, i: int, size: int, digest: str):
        """The bytes of chunk `i` if its file has `size` bytes and hash `digest`,
        else a string saying what is wrong with it."""
        file = self.chunk_file(i)
        try:
            with open(file, "rb") as f:
                data = f.read(size + 1)
        except FileNotFoundError:
            return "is missing"
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
        if len(data) != size:
            got = f"more than {size}" if len(data) > size else str(len(data))
            return f"has {got} bytes where the manifest recorded {size}"
        if sha256(data) != digest:
            return "does not match the SHA-256 the manifest recorded"
        return data

    def write(self, i: int, data: bytes) -> None:
        """Write chunk `i` atomically, then enter it in the manifest."""
        file = self.chunk_file(i)
        try:
            atomic_write(file, lambda f: f.write(data))
        except OSError as e:
            raise ValueError(f"cannot write {file}: {e.strerror or e}.") from None
        self.entries[i] = {"size": len(data), "sha256": sha256(data)}
        self._write_manifest()


# --------------------------------------------------------------------------------
# reading it back; several processes: process 0 decides, the others follow


def any_process(flag: bool, multi: bool) -> bool:
    """`flag` or-ed over the processes of a multi-process sweep (so that all stop
    at the same chunk)."""
    if not multi:
        return flag
    every = multihost_utils.process_allgather(np.asarray([flag], np.int32))
    return bool(np.any(every))


class CheckpointWarning(UserWarning):
    """A checkpoint chunk file that is not loaded (damaged, not matching the
    manifest, or not listed in it): it is recomputed and overwritten."""


def load_chunks(ckpt: Checkpoint, expected):
    """Open the checkpoint and read every chunk its manifest lists; return
    `{i: (bytes, leaves)}` of the sound ones and the files of the damaged ones,
    each named in a `CheckpointWarning` (as is every chunk file the manifest
    lacks)."""
    for file in ckpt.open():
        warnings.warn(
            f"checkpoint chunk {file} is not listed in {ckpt.manifest_file}: not "
            "loaded (it is recomputed and overwritten).",
            CheckpointWarning,
            stacklevel=2,
        )
    done, damaged = {}, []
    for i, entry in sorted(ckpt.entries.items()):
        data = ckpt.read(i, entry["size"], entry["sha256"])
        leaves = parse(data, expected(i)) if isinstance(data, bytes) else data
        if isinstance(leaves, str):
            file = ckpt.chunk_file(i)
            damaged.append(file)
            warnings.warn(
                f"checkpoint chunk {file} {leaves}: recomputing it.",
                CheckpointWarning,
                stacklevel=2,
            )
        else:
            done[i] = (data, leaves)
    return done, damaged


def agree(fingerprint: str, mesh: Mesh) -> None:
    """Raise in every process if the processes were called with different sweeps."""
    ids = np.asarray([d.id for d in mesh.devices.flat], np.int64)
    mine = hashlib.sha256(fingerprint.encode() + ids.tobytes()).digest()
    every = np.asarray(multihost_utils.process_allgather(np.frombuffer(mine, np.uint8)))
    differ = [p for p in range(every.shape[0]) if (every[p] != every[0]).any()]
    if differ:
        raise ValueError(
            f"process(es) {differ} called `sweep` with arguments different from "
            "process 0's (grid values, chunk, tag, function name, output structure "
            "or mesh): a multi-process sweep needs identical calls in every process."
        )


_ERROR_BYTES = 4096


def sync_chunks(ckpt: Checkpoint | None, n_chunks: int, expected):
    """Multi-process: process 0 reads the checkpoint and broadcasts which chunks
    are done with their hashes (or its error); every other process reads those
    chunks from its own folder where the hashes match, and process 0 broadcasts
    the bytes of the rest. Returns `{i: leaves}` and process 0's damaged files."""
    source = jax.process_index() == 0
    done, damaged, error = {}, [], ""
    if source and ckpt is not None:
        try:
            done, damaged = load_chunks(ckpt, expected)
        except ValueError as e:
            error = str(e)
    sizes = np.full(n_chunks, -1, np.int32)
    digests = np.zeros((n_chunks, 32), np.uint8)
    for i, (data, _) in done.items():
        if len(data) >= 2**31:
            error = f"checkpoint chunk {ckpt.chunk_file(i)} is over 2 GiB: use "
            error += "smaller chunks."
        sizes[i] = min(len(data), 2**31 - 1)
        digests[i] = np.frombuffer(bytes.fromhex(sha256(data)), np.uint8)
    message = np.frombuffer(
        error.encode()[:_ERROR_BYTES].ljust(_ERROR_BYTES, b"\0"), np.uint8
    )
    header = multihost_utils.broadcast_one_to_all((message, sizes, digests))
    message, sizes, digests = (np.asarray(x) for x in header)
    error = bytes(message).rstrip(b"\0").decode(errors="replace")
    if error:
        raise ValueError(error if source else f"process 0: {error}")

    listed = [i for i in range(n_chunks) if sizes[i] >= 0]
    results = {i: leaves for i, (_, leaves) in done.items()}
    if not source and ckpt is not None:
        for i in listed:
            data = ckpt.read(i, int(sizes[i]), bytes(digests[i]).hex())
            leaves = parse(data, expected(i)) if isinstance(data, bytes) else data
            if not isinstance(leaves, str):
                results[i] = leaves
    have = np.asarray([i in results for i in range(n_chunks)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(have)).reshape(-1, n_chunks)
    missing = [i for i in listed if not every[:, i].all()]
    if missing:  # the others cannot read process 0's folder: send the bytes
        if source:
            buffer = np.frombuffer(b"".join(done[i][0] for i in missing), np.uint8)
        else:
            buffer = np.zeros(int(sum(int(sizes[i]) for i in missing)), np.uint8)
        buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes()
        offset, bad = 0, []
        for i in missing:
            data, offset = buffer[offset : offset + sizes[i]], offset + int(sizes[i])
            if i in results:
                continue
            leaves = parse(data, expected(i))
            if sha256(data) != bytes(digests[i]).hex() or isinstance(leaves, str):
                bad.append(i)
            else:
                results[i] = leaves
        if any_process(bool(bad), multi=True):
            raise ValueError(
                f"checkpoint chunks {bad} sent by process 0 arrived damaged."
            )
    return results, damaged
