"""Progress meters: the one way long work shows how far it has got.

A meter is an object passed down to the work (as diffrax passes a
`progress_meter` to `diffeqsolve`): `sweep`, `run_demo`, `analyse_curve` and
`predict_file` take one as `progress=` (or `True`/`False` for the default meter
or none), and a driver hands its meter to what it calls. A meter opens a `Bar`
over a known number of steps; the bar counts steps done and shows a short
status (what it is doing now).
"""

import abc
from typing import Any

import equinox as eqx
from tqdm import tqdm


class Bar:
    """An open progress bar: `update(n)` steps done, `status(text)` what is being
    done now, `close()` (or use it as a context manager). The base class shows
    nothing."""

    def update(self, n: int = 1) -> None:
        """Count `n` more steps done."""

    def status(self, text: str) -> None:
        """Show `text` as what is being done now ("" clears it)."""

    def close(self) -> None:
        """Close the bar (idempotent)."""

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AbstractProgressMeter(eqx.Module):
    """How progress is shown. Subclass it and implement `bar` to send progress
    elsewhere (a log, a notebook widget, a cluster's status file)."""

    @abc.abstractmethod
    def bar(self, total: int, desc: str, unit: str = "step") -> Bar:
        """Open a bar over `total` steps labelled `desc`, counting in `unit`."""


class NoProgressMeter(AbstractProgressMeter):
    """Shows nothing."""

    def bar(self, total: int, desc: str, unit: str = "step") -> Bar:
        return Bar()


class _TqdmBar(Bar):
    def __init__(self, bar: Any):
        self._bar = bar

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def status(self, text: str) -> None:
        self._bar.set_postfix_str(text)

    def close(self) -> None:
        self._bar.close()


class TqdmProgressMeter(AbstractProgressMeter):
    """A `tqdm` bar on standard error (the default meter).

    **Fields:** `leave`: keep the finished bar on screen (default `True`).
    """

    leave: bool = eqx.field(static=True, default=True)

    def bar(self, total: int, desc: str, unit: str = "step") -> Bar:
        return _TqdmBar(tqdm(total=total, desc=desc, unit=unit, leave=self.leave))


def as_progress_meter(
    progress: "bool | AbstractProgressMeter",
) -> AbstractProgressMeter:
    """The meter that `progress` asks for: `True` the default `TqdmProgressMeter`,
    `False` a `NoProgressMeter`, a meter itself.

    **Raises:** `ValueError` for anything else, naming `progress`.
    """
    if isinstance(progress, AbstractProgressMeter):
        return progress
    if isinstance(progress, bool):
        return TqdmProgressMeter() if progress else NoProgressMeter()
    raise ValueError(
        "`progress` must be True, False or an nqfjax.AbstractProgressMeter, got "
        f"{progress!r}."
    )
