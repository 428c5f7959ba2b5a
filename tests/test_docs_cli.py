"""The documentation of the command line cannot go stale: every command and
every long option of `nqfjax/cli.py`'s parser is in `docs/cli.md`, every command
in the command lists of `docs/index.md` and the README, and every key `fit.json`
has is in `docs/cli.md` (fast: the parser is built, nothing is run)."""

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import numpy as np
import pytest

import nqfjax
from nqfjax import cli, experiments


ROOT = Path(__file__).resolve().parents[1]
CLI_DOC = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")


def _commands() -> dict[str, argparse.ArgumentParser]:
    """The subcommands of the library's own parser, by name."""
    parser = cli._parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    )


def test_the_parser_has_the_commands():
    # the parser is what the tests below read: make sure they read something
    assert {"demo", "sweep", "fit", "predict"} <= set(_commands())


@pytest.mark.parametrize("command", sorted(_commands()))
def test_cli_md_documents_every_command_and_option(command):
    assert f"## `nqfjax {command}" in CLI_DOC, f"docs/cli.md has no section {command}"
    assert re.search(rf"^nqfjax {command}\b", CLI_DOC, re.M), "not in the synopsis"
    section = CLI_DOC.split(f"## `nqfjax {command}", 1)[1].split("\n## ", 1)[0]
    missing = [
        option
        for option in _long_options(_commands()[command])
        if option != "--help" and f"`{option}" not in section
    ]
    assert not missing, f"docs/cli.md, nqfjax {command}: {missing} undocumented"


def test_cli_md_documents_the_top_level_options():
    for option in _long_options(cli._parser()):  # --version; --help is everywhere
        assert f"nqfjax {option}" in CLI_DOC or option == "--help"


def test_index_and_readme_list_every_command():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    (row,) = [line for line in index.splitlines() if "(cli.md)" in line]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The command line", 1)[1].split("\n## ", 1)[0]
    for command in _commands():
        assert f"`nqfjax {command}" in row, f"docs/index.md lacks nqfjax {command}"
        assert f"`nqfjax {command}" in section, f"README lacks nqfjax {command}"
    listed = set(re.findall(r"`nqfjax (\w+)", row))
    assert listed <= set(_commands()), f"docs/index.md lists {listed}"


# --------------------------------------------------------------------------------
# fit.json: built by the library's own code from placeholder results, so a key
# added to the summary fails here until docs/cli.md names it.


def _placeholder(cls, **given):
    """An instance of a result module with placeholder values in every field."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if not field.init or field.default is not dataclasses.MISSING:
            continue
        kind = hints[field.name]
        if kind in (str, int, float, bool, dict):
            kwargs[field.name] = {str: "x", int: 1, float: 1.0, bool: True}.get(
                kind, {"a": 1.0}
            )
        elif typing.get_origin(kind) is tuple:
            kwargs[field.name] = (1.0, 2.0)
        elif getattr(kind, "dim_str", None) == "":  # a jaxtyping scalar
            kwargs[field.name] = np.float64(1.0)
        else:
            kwargs[field.name] = np.ones(2)
    return cls(**{**kwargs, **given})


def _fit_json(analysis) -> dict:
    curve = experiments.Curve(analysis.ts, analysis.loss, "t", "loss")
    files = {"summary": "fit.json", "figure": "fit.png"}
    out = experiments.FitOutput(
        source="curve.csv", curve=curve, analysis=analysis, files=files
    )
    return out.as_dict()


def _keys(summary: dict) -> set[str]:
    """The top-level keys, and those of each analysis' entry and of `columns`
    (not the model names under `scores`, the libraries under `versions` or the
    names under `files`)."""
    keys = set(summary)
    for name, value in summary.items():
        if isinstance(value, dict) and name not in ("versions", "files"):
            keys |= set(value)
    return keys


def test_cli_md_documents_every_fit_json_key():
    ts, loss = np.arange(10.0), np.linspace(1.0, 0.1, 10)
    found = experiments.CurveAnalysis(
        ts=ts,
        loss=loss,
        model=_placeholder(nqfjax.ModelSelection),
        plateaus=_placeholder(nqfjax.Plateaus),
        power_law=_placeholder(nqfjax.PowerLawFit),
        spectrum=_placeholder(nqfjax.SpectrumFit),
        forecast=_placeholder(nqfjax.Forecast),
        forecast_to=20.0,
    )
    empty = np.zeros(0)
    nothing = experiments.CurveAnalysis(
        ts=ts,
        loss=loss,
        model=experiments.Failed("an error"),
        plateaus=_placeholder(
            nqfjax.Plateaus,
            **{f: empty for f in ("start", "end", "level", "level_err")},
            **{f: empty for f in ("drop", "drop_err", "drop_times", "drop_times_err")},
            reason="no plateau",
        ),
        power_law=experiments.Skipped("a reason"),
    )
    keys = _keys(_fit_json(found)) | _keys(_fit_json(nothing))
    # the analyses themselves, so that a rename cannot empty the test
    assert {"model", "plateaus", "power_law", "spectrum", "forecast"} <= keys
    assert {"error", "found", "reason", "gamma_err", "uncertainty"} <= keys
    section = CLI_DOC.split("## `nqfjax fit", 1)[1].split("\n## ", 1)[0]
    missing = sorted(key for key in keys if f"`{key}`" not in section)
    assert not missing, f"docs/cli.md does not describe fit.json's {missing}"
