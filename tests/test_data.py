"""The real data sets of `nqfjax.data.load_dataset`: shapes, standardisation,
targets, reproducibility and errors that name the argument."""

import random

import numpy as np
import pytest

from nqfjax.data import DATASETS, load_dataset


pytest.importorskip("sklearn")
pytest.importorskip("mnist1d")

# (name, n requested, expected d after dropping constant features, k one-hot)
CASES = [
    ("wine", None, 13, 3),
    ("iris", 100, 4, 3),
    ("breast_cancer", 200, 30, 2),
    ("digits", 300, None, 10),
    ("mnist1d", 120, 40, 10),
]


@pytest.mark.parametrize("name,n,d,k", CASES, ids=[c[0] for c in CASES])
def test_shapes_and_standardisation(name, n, d, k):
    xs, ys = load_dataset(name, n=n, dtype=np.float64)
    n_expected = DATASETS[name][0] if n is None else n
    assert xs.shape[0] == ys.shape[0] == n_expected
    assert ys.shape[1] == k
    if d is not None:
        assert xs.shape[1] == d
    else:  # digits: the always-blank border pixels are dropped
        assert 50 <= xs.shape[1] < 64
    assert xs.dtype == ys.dtype == np.float64
    # float64 arithmetic on O(1) numbers: 1e-6 leaves room for n ~ 1e3 sums
    np.testing.assert_allclose(xs.mean(0), 0.0, atol=1e-6)
    np.testing.assert_allclose(xs.std(0), 1.0, atol=1e-6)
    np.testing.assert_allclose(ys.mean(0), 0.0, atol=1e-6)
    # centred one-hot: each row is e_c minus the class frequencies
    freq = -ys.min(0)
    np.testing.assert_allclose(ys + freq, np.round(ys + freq), atol=1e-6)
    np.testing.assert_allclose(np.sum(ys + freq, axis=1), 1.0, atol=1e-6)


def test_float32_default_and_not_whitened():
    xs, ys = load_dataset("wine")
    assert xs.dtype == ys.dtype == np.float32
    cov = np.cov(xs.astype(np.float64), rowvar=False, bias=True)
    # standardised, not whitened: unit diagonal, correlations left in
    np.testing.assert_allclose(np.diag(cov), 1.0, atol=1e-5)  # float32 rounding
    assert np.max(np.abs(cov - np.diag(np.diag(cov)))) > 0.5  # wine's flavanoids


def test_whiten_and_pca():
    xs, _ = load_dataset("wine", whiten=True, dtype=np.float64)
    cov = xs.T @ xs / xs.shape[0]
    np.testing.assert_allclose(cov, np.eye(xs.shape[1]), atol=1e-8)
    # PCA scores keep their variances (the eigenvalues of the correlation matrix)
    full, _ = load_dataset("breast_cancer", dtype=np.float64)
    xs, _ = load_dataset("breast_cancer", pca=5, dtype=np.float64)
    assert xs.shape == (569, 5)
    eig = np.sort(np.linalg.eigvalsh(full.T @ full / 569))[::-1][:5]
    np.testing.assert_allclose(xs.T @ xs / 569, np.diag(eig), atol=1e-8)


def test_label_target_and_regression():
    _, ys = load_dataset("iris", target="label", dtype=np.float64)
    assert ys.shape == (150, 1)
    np.testing.assert_allclose([ys.mean(), ys.std()], [0.0, 1.0], atol=1e-12)
    # iris: 50 of each class 0, 1, 2 -> labels standardised to -sqrt(3/2), 0, ...
    np.testing.assert_allclose(np.unique(ys), [-np.sqrt(1.5), 0, np.sqrt(1.5)])
    xs, ys = load_dataset("diabetes", target="label")
    assert xs.shape == (442, 10) and ys.shape == (442, 1)


def test_subsets_are_seeded_and_mnist1d_keeps_global_rng():
    a = load_dataset("digits", n=50, seed=3)[0]
    b = load_dataset("digits", n=50, seed=3)[0]
    c = load_dataset("digits", n=50, seed=4)[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.random.seed(123)
    random.seed(123)
    expected = (np.random.rand(), random.random())
    np.random.seed(123)
    random.seed(123)
    x1 = load_dataset("mnist1d", n=30, seed=1)[0]
    assert (np.random.rand(), random.random()) == expected
    np.testing.assert_array_equal(x1, load_dataset("mnist1d", n=30, seed=1)[0])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"name": "mnist"}, "`name` must be one of"),
        ({"name": "wine", "n": 0}, "`n` must be an integer >= 2"),
        ({"name": "wine", "n": 2.5}, "`n` must be an integer"),
        ({"name": "wine", "seed": -1}, "`seed` must be an integer >= 0"),
        ({"name": "wine", "target": "ordinal"}, "`target` must be one of"),
        ({"name": "diabetes"}, "`target` must be 'label'"),
        ({"name": "wine", "whiten": "yes"}, "`whiten` must be True or False"),
        ({"name": "wine", "pca": 14}, "`pca` must be at most the 13"),
        ({"name": "wine", "dtype": np.int32}, "`dtype` must be a floating dtype"),
    ],
)
def test_errors_name_the_argument(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        load_dataset(name, **kwargs)
