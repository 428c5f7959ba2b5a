"""What a driver's step gives back when it has no result of the library's: it
found nothing to report (`Skipped`) or it raised (`Failed`); and the one
deprecated dict view of a driver's result (for one release)."""

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx


class Skipped(eqx.Module):
    """A step that found nothing to report (a loss that is zero, flat or rising
    has no power law; a refused spectrum fit has no spectrum).

    **Fields:** `reason`: why, one line."""

    reason: str = eqx.field(static=True)


class Failed(eqx.Module):
    """A step that raised a `ValueError` or `RuntimeError`; the driver went on.

    **Fields:** `error`: the exception's message on one line."""

    error: str = eqx.field(static=True)


def attempt(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)`, or `Failed(message)` if it raises a `ValueError` or
    `RuntimeError` (a failed fit is a result, reported, not an exception)."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, RuntimeError) as e:
        return Failed(" ".join(str(e).split()))


def found_or_skipped(result: Any) -> Any:
    """A library result with `found` and `reason`: itself if found, else
    `Skipped(reason)`."""
    return result if result.found else Skipped(result.reason)


class DictView(eqx.Module):
    """Reading a driver's result as the dict it used to be (`result["key"]`,
    `"key" in result`, `result.get`): deprecated, it warns and reads `as_dict()`.
    Subclasses define `as_dict()`, the JSON-able summary."""

    def as_dict(self) -> dict:
        raise NotImplementedError

    def _dict(self) -> dict:
        warnings.warn(
            f"reading {type(self).__name__} as a dict is deprecated (it was the "
            "driver's return value): read its fields instead.",
            DeprecationWarning,
            stacklevel=3,
        )
        return self.as_dict()

    def __getitem__(self, key: str) -> Any:
        return self._dict()[key]

    def __contains__(self, key: str) -> bool:
        return key in self._dict()

    def get(self, key: str, default: Any = None) -> Any:
        return self._dict().get(key, default)
