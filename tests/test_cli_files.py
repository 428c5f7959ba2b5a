"""Malformed, truncated, mis-encoded and hostile files given to every command
that reads one: `fit` (a CSV loss curve), `predict` (a `.npz` or `.csv` data
file) and `sweep` (a TOML configuration), generated with hypothesis.

The property: exit status 2, exactly one line on stderr (`nqfjax: error: ...`)
naming the file, no traceback, and nothing written (the `--out` folder absent,
nothing new beside the input). Every generated file is invalid by
construction (a prefix of a valid file that the format makes incomplete, a
damaged byte the CRC sees, a value out of range, ...), and the stage after
reading is replaced by one that fails the test: a file the command accepts
would be a wrong example, never a long run of JAX work. Each example costs
milliseconds; the properties are the slow tier, the regression tests of the
damaged `.npz` are not.
"""

import contextlib
import importlib
import io
import os
import pickle
import struct
import tempfile
import zipfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import nqfjax
from nqfjax.cli import main
from nqfjax.data import load_data_file
from nqfjax.experiments import curve as curve_mod, sweep_config


# the module, not the function of the same name that nqfjax.experiments exports
predict_file = importlib.import_module("nqfjax.experiments.predict_file")


_SETTINGS = settings(derandomize=True, max_examples=40, deadline=None, database=None)

#: Content meaning "make a folder at the file's path".
_FOLDER = "<a folder>"


class _ReachedWork(AssertionError):
    """Raised by the stage after reading: the command accepted the file."""


def _reached_work(*args, **kwargs):
    raise _ReachedWork("the command accepted the file and went on to work")


# the first stage of each command after its file is read and checked
_WORK = {
    "fit": (curve_mod, "analyse_curve"),
    "predict": (predict_file, "structure_for_data"),
    "sweep": (nqfjax, "run_sweep_config"),
}


def _refuses(command: str, name: str, content) -> str:
    """Write `content` (bytes, or `_FOLDER`) to a file `name` in a new folder,
    run `nqfjax COMMAND FILE --out OUT --quiet` there, check that it is refused
    cleanly and return the error line."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        path = Path(tmp) / name
        if content == _FOLDER:
            path.mkdir()
        else:
            path.write_bytes(content)
        out = Path(tmp) / "out"
        stdout, stderr = io.StringIO(), io.StringIO()
        with (
            mock.patch.object(*_WORK[command], _reached_work),
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
        ):
            status = main([command, str(path), "--out", str(out), "--quiet"])
        err = stderr.getvalue()
        assert "Traceback" not in err + stdout.getvalue()
        assert status == 2, (status, err)
        assert err.endswith("\n") and err.count("\n") == 1, err
        (line,) = err.splitlines()
        assert line.startswith("nqfjax: error: ") and str(path) in line, line
        # nothing written: no output folder, nothing beside the input (also no
        # folder made by a hostile pickle, see `_Hostile`)
        assert os.listdir(tmp) == [name], os.listdir(tmp)
        return line


def _prefixes(data: bytes) -> st.SearchStrategy[bytes]:
    """The proper prefixes of `data`."""
    return st.integers(0, len(data) - 1).map(lambda k: data[:k])


def _insert(text: str, char: st.SearchStrategy[str], lo: int = 0):
    """`text` with one `char` inserted at a position >= `lo`."""
    return st.tuples(st.integers(lo, len(text)), char).map(
        lambda a: text[: a[0]] + a[1] + text[a[0] :]
    )


# encodings of ASCII text that are not UTF-8 (UTF-16/32 with and without a
# byte-order mark: NUL bytes; EBCDIC: bytes no UTF-8 decoder accepts)
_ENCODINGS = ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-be", "cp500")


def _mis_encoded(text: str, boms: bool = True) -> st.SearchStrategy[bytes]:
    """`text` in another encoding than UTF-8, with a latin-1 letter inserted
    (one byte >= 0x80 between ASCII ones, which UTF-8 never has), or with
    `boms` after two UTF-8 byte-order marks (the second one is read as part of
    the first name)."""
    return st.one_of(
        st.sampled_from(_ENCODINGS).map(text.encode),
        _insert(text, st.sampled_from("éüß°µÿ")).map(lambda t: t.encode("latin-1")),
        st.just(b"\xef\xbb\xbf" * 2 + text.encode()) if boms else st.nothing(),
    )


_RANDOM = st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode))


# --------------------------------------------------------------------------------
# fit: a CSV loss curve

# exactly MIN_POINTS rows, the time column last: cut anywhere, the last row
# has a field missing or empty, or a time below the one before (90 -> 9)
_CURVE = "loss,step\n" + "\n".join(
    f"{0.5 / (i + 1):.4f},{10 * i}" for i in range(curve_mod.MIN_POINTS)
)
_CURVE_ROWS = [line.split(",") for line in _CURVE.splitlines()[1:]]

# values a loss or time cell cannot hold: not a number, not finite (also
# beyond float's range), negative, longer than csv's field limit
_BAD_CELLS = (
    "", "abc", "nan", "NaN", "inf", "-inf", "1e999", "9" * 400, "-1", "0x10",
    "1.0.0", "∞", "x" * 200_000,
)  # fmt: skip


def _bad_cell(args) -> bytes:
    row, col, cell = args
    rows = [list(r) for r in _CURVE_ROWS]
    rows[row][col] = cell
    return ("loss,step\n" + "\n".join(map(",".join, rows))).encode()


_FIT_FILES = {
    "truncated": _prefixes(_CURVE.encode()),
    "mis-encoded": _mis_encoded(_CURVE),
    "random": _RANDOM,
    "nul": _insert(_CURVE, st.just("\x00")).map(str.encode),
    "hostile": st.one_of(
        st.tuples(
            st.integers(0, len(_CURVE_ROWS) - 1),
            st.integers(0, 1),
            st.sampled_from(_BAD_CELLS),
        ).map(_bad_cell),
        st.sampled_from(
            [
                _FOLDER,
                b"",
                b"\n \n# only a comment\n",
                b"loss,step\n",
                # times decreasing, or repeated
                "\n".join(
                    _CURVE.splitlines()[:1] + _CURVE.splitlines()[:0:-1]
                ).encode(),
                ("loss,step\n" + "0.1,1\n" * 10**5).encode(),
            ]
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_FIT_FILES))
@_SETTINGS
@given(data=st.data())
def test_fit_refuses_bad_csv(kind, data):
    _refuses("fit", "curve.csv", data.draw(_FIT_FILES[kind]))


# --------------------------------------------------------------------------------
# predict: a .npz (or .csv) data file


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def _zip(members: dict[str, bytes], **kwargs) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", **kwargs) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buf.getvalue()


_RNG = np.random.default_rng(0)
_XS, _YS = _RNG.standard_normal((6, 3)), _RNG.standard_normal((6, 2))
_GOOD = {"xs.npy": _npy(_XS), "ys.npy": _npy(_YS)}
_NPZ = _zip(_GOOD)  # as numpy.savez writes it: members stored, not compressed
_NPZ_COMPRESSED = _zip(_GOOD, compression=zipfile.ZIP_DEFLATED)


def _data_ranges(archive: bytes) -> list[int]:
    """The offsets of the members' stored bytes."""
    offsets = []
    for info in zipfile.ZipFile(io.BytesIO(archive)).infolist():
        name_len, extra_len = struct.unpack_from(
            "<HH", archive, info.header_offset + 26
        )
        start = info.header_offset + 30 + name_len + extra_len
        offsets += range(start, start + info.compress_size)
    return offsets


_NPZ_DATA = _data_ranges(_NPZ)


def _flip(args) -> bytes:
    """`_NPZ` with one byte of a member changed (stored: every byte is
    the data, which the CRC-32 checks)."""
    index, mask = args
    damaged = bytearray(_NPZ)
    damaged[_NPZ_DATA[index]] ^= mask
    return bytes(damaged)


class _Hostile:
    """Unpickled, it makes a folder `PWNED` in the current folder."""

    def __reduce__(self):
        return os.makedirs, ("PWNED", 0o777, True)


_PICKLED = _npy(np.array([_Hostile(), _Hostile()], dtype=object))


def _header(text: str, version: bytes = b"\x01\x00") -> bytes:
    """A .npy file with the header `text`, and 48 bytes of data."""
    raw = text.encode("latin-1", "replace")
    return b"\x93NUMPY" + version + struct.pack("<H", len(raw)) + raw + bytes(48)


def _shape_header(shape) -> bytes:
    return _header(f"{{'descr': '<f8', 'fortran_order': False, 'shape': {shape}, }}")


def _with_xs(xs: bytes) -> bytes:
    return _zip({"xs.npy": xs, "ys.npy": _GOOD["ys.npy"]})


def _patched(archive: bytes, *, method: int | None = None, flags: int = 0) -> bytes:
    """`archive` with its members' compression method (local and central
    headers) set to `method`, or `flags` set in their general-purpose bits."""
    out = bytearray(archive)
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        start = out.find(signature)
        while start >= 0:
            if method is not None:
                struct.pack_into("<H", out, start + flag_at + 2, method)
            (bits,) = struct.unpack_from("<H", out, start + flag_at)
            struct.pack_into("<H", out, start + flag_at, bits | flags)
            start = out.find(signature, start + 4)
    return bytes(out)


_DTYPE_ARRAYS = [
    np.array([["a", "b"], ["c", "d"]]),
    np.array([[b"a"], [b"b"]]),
    np.zeros((3, 2), dtype=[("a", "<f8"), ("b", "<i4")]),
    np.zeros((3, 2), dtype=[("a", "<f8"), ("b", "O")]),
    np.array([["2020-01-01"]] * 3, dtype="M8[D]"),
    np.ones((3, 2), dtype="m8[s]"),
    np.ones((3, 2)) + 1j,
    np.zeros((3, 2), dtype="V8"),
]

# header literals that `ast.literal_eval` chokes on or that are not a header
_HEADERS = [
    "-" * 5000 + "1",
    "not " * 3000 + "1",
    "{[1]: 2}",
    "{",  # not a literal: read again with `tokenize`, which fails too
    "{'descr': '<f8', 'shape': (6,",
    "(" * 300 + ")" * 300,
    "{'descr': '<f8', 'fortran_order': False}",
    "{'descr': 'no such type', 'fortran_order': False, 'shape': (6,), }",
    "{'descr': '<f8', 'fortran_order': 'yes', 'shape': (6,), }",
    "{'descr': '<f8', 'fortran_order': False, 'shape': (6.0,), }",
    "{'descr': '<f8', 'fortran_order': False, 'shape': (6,), }" + " " * 20000,
    "[1, 2, 3]",
    "",
]


def _shapes_and_values():
    """Arrays of numbers that are not data: wrong shapes, empty, one sample,
    NaN, inf, numbers too large for float32."""
    nan = np.array(_XS)
    nan[3, 1] = np.nan
    return [
        {"xs": _XS[:, 0], "ys": _YS},
        {"xs": np.float64(1.0), "ys": _YS},
        {"xs": _XS, "ys": np.ones((6, 2, 2))},
        {"xs": _XS, "ys": _YS[:5]},
        {"xs": _XS[:1], "ys": _YS[:1]},
        {"xs": np.ones((0, 3)), "ys": np.ones((0, 2))},
        {"xs": np.ones((6, 0)), "ys": _YS},
        {"xs": _XS, "ys": np.ones((6, 0))},
        {"xs": nan, "ys": _YS},
        {"xs": _XS, "ys": np.full((6, 2), np.inf)},
        {"xs": np.full((6, 3), 1e300), "ys": _YS},
        {"xs": _XS},
        {"ys": _YS},
        {},
    ]


_HOSTILE_NPZ = st.one_of(
    # an object array whose pickle, loaded, would make a folder
    st.sampled_from(
        [_with_xs(_PICKLED), _zip({"xs.npy": _PICKLED, "ys.npy": _PICKLED})]
    ),
    st.just(pickle.dumps(np.array([_Hostile()], dtype=object))),  # a bare pickle
    # absurd sizes in the header (at least one dimension of 2**31 or more, or
    # a negative one)
    st.lists(
        st.one_of(
            st.integers(0, 10), st.integers(2**31, 2**64), st.integers(-(2**63), -1)
        ),
        min_size=1,
        max_size=4,
    )
    .filter(lambda s: any(n >= 2**31 or n < 0 for n in s))
    .map(lambda s: _with_xs(_shape_header(tuple(s)))),
    st.sampled_from(_DTYPE_ARRAYS).map(lambda a: _with_xs(_npy(a))),
    st.sampled_from(_HEADERS).map(lambda h: _with_xs(_header(h))),
    st.text(max_size=200).map(lambda h: _with_xs(_header(h))),
    st.sampled_from([b"\x00\x00", b"\x03\x00", b"\xff\xff"]).map(
        lambda v: _with_xs(_header("{}", v))
    ),
    st.sampled_from(_shapes_and_values()).map(
        lambda arrays: _zip({f"{k}.npy": _npy(v) for k, v in arrays.items()})
    ),
    st.sampled_from(
        [
            _zip({"xs": _GOOD["xs.npy"], "ys.npy": _GOOD["ys.npy"]}),  # no .npy
            _zip({"xs.npy": b"", "ys.npy": b""}),
            _zip({"xs.npy": b"\x93NUMPY", "ys.npy": _GOOD["ys.npy"]}),
            _zip({}),
            _patched(_NPZ, flags=0x1),  # encrypted
            _patched(_NPZ, method=99),  # an unknown compression method
            _patched(_NPZ_COMPRESSED, method=zipfile.ZIP_LZMA),  # the wrong one
            _NPZ_COMPRESSED[: len(_NPZ_COMPRESSED) // 2],
            _GOOD["xs.npy"],  # a .npy file, not .npz
            _FOLDER,
            b"",
        ]
    ),
)

# a data CSV of exactly two samples whose cells are one character at the end of
# each row: cut anywhere, a row is short or empty-celled, or one sample is left
_DATA_CSV = "x1,x2,y\n0.5,1.5,1\n-1,2,0"

_PREDICT_FILES = {
    "truncated": st.one_of(
        _prefixes(_NPZ).map(lambda b: ("data.npz", b)),
        _prefixes(_NPZ_COMPRESSED).map(lambda b: ("data.npz", b)),
        _prefixes(_DATA_CSV.encode()).map(lambda b: ("data.csv", b)),
    ),
    "damaged": st.tuples(st.integers(0, len(_NPZ_DATA) - 1), st.integers(1, 255))
    .map(_flip)
    .map(lambda b: ("data.npz", b)),
    "mis-encoded": st.one_of(
        # (two byte-order marks would only rename the first feature)
        _mis_encoded(_DATA_CSV, boms=False).map(lambda b: ("data.csv", b)),
        _mis_encoded(_DATA_CSV).map(lambda b: ("data.npz", b)),
        st.sampled_from([("data.npy", _NPZ), ("data.txt", _DATA_CSV.encode())]),
    ),
    "random": st.tuples(st.sampled_from(["data.npz", "data.csv"]), _RANDOM),
    # NUL bytes in the rows (a NUL in the header could leave a valid name)
    "nul": _insert(_DATA_CSV, st.just("\x00"), lo=len("x1,x2,y\n")).map(
        lambda t: ("data.csv", t.encode())
    ),
    "hostile": _HOSTILE_NPZ.map(lambda b: ("data.npz", b)),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_PREDICT_FILES))
@_SETTINGS
@given(data=st.data())
def test_predict_refuses_bad_data_file(kind, data):
    name, content = data.draw(_PREDICT_FILES[kind])
    _refuses("predict", name, content)


# --------------------------------------------------------------------------------
# sweep: a TOML configuration

# required `grid.learning_rate` last, its value closed by the last character:
# cut anywhere, the TOML is invalid or the key is missing
_CONFIG = """\
[data]
n_samples = 8
teacher_units = 1
seed = 0

[train]
num_steps = 20
width = 2
num_records = 4

[architectures.perceptron]
d = 2
k = 1

[grid]
init_scale = [0.01]
seed = [0]
learning_rate = [0.05]"""

# the value of one key: (the text it is written as, the kind it must be)
_VALUES = {
    "n_samples = 8": "int",
    "teacher_units = 1": "int",
    "seed = 0": "int",
    "num_steps = 20": "int",
    "width = 2": "int",
    "num_records = 4": "int",
    "d = 2": "int",
    "k = 1": "int",
    "init_scale = [0.01]": "float",
    "seed = [0]": "int",
    "learning_rate = [0.05]": "float",
}

# gigantic or non-finite numbers: an integer key takes none of them (2**31 or
# more in magnitude, a float, more than 4300 digits), a float key none of
# those that are not finite
_HUGE_NUMBERS = st.one_of(
    st.sampled_from(["inf", "-inf", "nan", "+nan", "1e400", "-1e400"]),
    st.integers(309, 5000).map(lambda n: "9" * n),
    st.integers(309, 5000).map(lambda n: "-" + "9" * n),
)
_HUGE_INTEGERS = st.one_of(
    _HUGE_NUMBERS,
    st.integers(2**31, 2**200).map(str),
    st.integers(-(2**200), -(2**31)).map(str),
    st.sampled_from(["1.5", "2e9", "0x7fffffff_ffffffff", "2147483648"]),
)


def _substitute(args) -> bytes:
    line, value = args
    key, _, old = line.partition(" = ")
    new = f"[{value}]" if old.startswith("[") else value
    assert line in _CONFIG
    return _CONFIG.replace(line, f"{key} = {new}", 1).encode()


def _nested(args) -> bytes:
    """`learning_rate` nested `depth` arrays or inline tables deep."""
    depth, table = args
    value = "{a = " * depth + "1" + "}" * depth if table else "[" * depth + "]" * depth
    return _CONFIG.replace(
        "learning_rate = [0.05]", f"learning_rate = {value}"
    ).encode()


_CONTROL = st.sampled_from(
    [chr(c) for c in [*range(0, 9), 11, 12, *range(14, 32), 127]]
)

_SWEEP_FILES = {
    "truncated": _prefixes(_CONFIG.encode()),
    "mis-encoded": _mis_encoded(_CONFIG),
    "random": _RANDOM,
    "nul": _insert(_CONFIG, st.one_of(st.just("\x00"), _CONTROL)).map(str.encode),
    "hostile": st.one_of(
        st.sampled_from(sorted(_VALUES))
        .flatmap(
            lambda line: st.tuples(
                st.just(line),
                _HUGE_INTEGERS if _VALUES[line] == "int" else _HUGE_NUMBERS,
            )
        )
        .map(_substitute),
        st.tuples(st.integers(1, 100_000), st.booleans()).map(_nested),
        st.sampled_from(
            [
                _FOLDER,
                b"",
                (_CONFIG + "\nlearning_rate = [0.1]").encode(),  # a repeated key
                (_CONFIG + "\n[bogus]\nx = 1").encode(),
                _CONFIG.replace("= 8", '= "' + "8" * 100_000 + '"').encode(),
                ("# " + "x" * 100_000 + "\n").encode(),
            ]
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_SWEEP_FILES))
@_SETTINGS
@given(data=st.data())
def test_sweep_refuses_bad_config(kind, data):
    _refuses("sweep", "config.toml", data.draw(_SWEEP_FILES[kind]))


# --------------------------------------------------------------------------------
# the files damaged above are valid, the hostile pickle is live, and the
# damaged .npz of the bug report (fast)


@pytest.mark.slow
def test_the_files_damaged_above_are_valid(tmp_path):
    # what the properties damage is accepted whole: the damage is what fails
    (tmp_path / "curve.csv").write_text(_CURVE)
    curve = curve_mod.read_curve_csv(tmp_path / "curve.csv")
    assert len(curve.ts) == curve_mod.MIN_POINTS
    for name, content in [
        ("data.npz", _NPZ),
        ("compressed.npz", _NPZ_COMPRESSED),
        ("data.csv", _DATA_CSV.encode()),
    ]:
        (tmp_path / name).write_bytes(content)
        xs, ys = load_data_file(tmp_path / name)
        assert xs.shape[0] == ys.shape[0] >= 2
    np.testing.assert_allclose(load_data_file(tmp_path / "data.npz")[0], _XS, 1e-6)
    (tmp_path / "config.toml").write_text(_CONFIG)
    config = sweep_config.load_sweep_config(tmp_path / "config.toml")
    assert config.grid["learning_rate"] == [0.05]


def test_the_hostile_pickle_runs_when_unpickled(tmp_path, monkeypatch):
    # what `_refuses` checks for (no folder PWNED) would be there had nqfjax
    # loaded the pickle
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.npz").write_bytes(_with_xs(_PICKLED))
    with np.load(tmp_path / "data.npz", allow_pickle=True) as data:
        data["xs"]
    assert (tmp_path / "PWNED").is_dir()


@pytest.mark.parametrize(
    "content,problem",
    [
        (_NPZ[: len(_NPZ) // 2], "File is not a zip file"),
        (_flip((len(_NPZ_DATA) - 1, 0xFF)), "Bad CRC-32 for file 'ys.npy'"),
        (_with_xs(_PICKLED), "`xs` holds Python objects"),
    ],
    ids=["truncated", "bad-crc", "pickled"],
)
def test_damaged_npz_is_one_line_not_a_traceback(content, problem):
    # the bug: `zipfile.BadZipFile` escaped `nqfjax predict` with a traceback
    line = _refuses("predict", "data.npz", content)
    assert problem in line, line
