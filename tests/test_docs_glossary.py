"""Every word and symbol the reports print is in `docs/glossary.md`: the terms
of the demo report's own glossary (`report.md`), the labels and symbols of
`nqfjax fit`'s and `nqfjax predict`'s printed summaries (fast: the printing code
runs on placeholder results, nothing is fitted or trained)."""

import re
import types
from pathlib import Path

import numpy as np
from test_docs_cli import _placeholder

import nqfjax
from nqfjax import cli, experiments
from nqfjax.experiments import _report


ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = (ROOT / "docs" / "glossary.md").read_text(encoding="utf-8")
# a piece of a heading: split at commas, " / ", and an opening parenthesis
# after a space (so `A(x)` stays whole; the closing one is dropped in `_pieces`)
_PIECES = re.compile(r",\s*|\s+/\s+|\s+\(")


def _norm(text: str) -> str:
    """A term without markup: no `$`, backslashes, braces, quotes or backticks,
    lower case, single spaces."""
    text = re.sub(r"[$\\{}\"`*]", "", text)
    return " ".join(text.lower().split())


def _pieces(heading: str) -> set[str]:
    pieces = set()
    for piece in map(_norm, _PIECES.split(heading)):
        while piece.count(")") > piece.count("("):
            piece = piece[::-1].replace(")", "", 1)[::-1]
        if piece:
            pieces.add(piece)
    return pieces


def _defined() -> set[str]:
    """The terms the glossary defines: every piece of every entry's heading
    (the line before a `:   ` definition)."""
    headings = re.findall(r"^(\S.*)\n:   ", GLOSSARY, re.MULTILINE)
    assert len(headings) > 50  # the glossary was parsed
    return set().union(*map(_pieces, headings))


def _split_symbol(piece: str) -> list[str]:
    """`"switch-on time t_k"` -> the name and its symbol, each to be defined."""
    words = piece.split()
    if len(words) > 1 and re.fullmatch(r"\w(_\w+)?(\(x\))?", words[-1]):
        return [" ".join(words[:-1]), words[-1]]
    return [piece]


def _missing(terms) -> list[str]:
    """The terms not defined, in the singular or (as printed) the plural."""
    defined = _defined()
    return sorted({t for t in terms if not {t, t.removesuffix("s")} & defined})


def test_the_demo_reports_glossary_is_in_the_docs_glossary():
    terms = [
        t
        for name, _ in _report.GLOSSARY
        for piece in _pieces(name)
        for t in _split_symbol(piece)
    ]
    assert len(terms) >= len(_report.GLOSSARY)
    missing = _missing(terms)
    assert not missing, f"docs/glossary.md lacks the demo report's {missing}"


def _fit_lines() -> list[str]:
    """`nqfjax fit`'s printed lines, on placeholder results of every step."""
    ts, loss = np.arange(10.0), np.linspace(1.0, 0.1, 10)
    analysis = experiments.CurveAnalysis(
        ts=ts,
        loss=loss,
        model=_placeholder(nqfjax.ModelSelection, criterion="BIC"),
        plateaus=_placeholder(nqfjax.Plateaus),
        power_law=_placeholder(nqfjax.PowerLawFit),
        spectrum=_placeholder(nqfjax.SpectrumFit),
        forecast=_placeholder(nqfjax.Forecast),
        forecast_to=20.0,
    )
    return [
        f"{label}: {cli._fit_line(getattr(analysis, name), analysis)}"
        for label, name in cli._FIT_LINES
    ]


def _printed_terms(lines: list[str]) -> set[str]:
    """The labels (`label: ...`), the symbols given values (`name = ...`), the
    qualifiers in parentheses (`(rich)`) and the criterion (`by BIC`)."""
    terms = set()
    for line in lines:
        label, _, rest = line.partition(": ")
        terms.add(_norm(re.sub(r"\s*\(.*\)", "", label)))
        terms |= {_norm(s) for s in re.findall(r"\b([A-Za-z_]+) =", rest)}
        terms |= {_norm(s) for s in re.findall(r"\(([a-z]+)\)", rest)}
        terms |= {_norm(s) for s in re.findall(r"\bby (\w+)", rest)}
        terms |= {_norm(s) for s in re.findall(r"\b(runner-up)\b", rest)}
    return terms


def test_fit_prints_only_glossary_terms():
    terms = _printed_terms(_fit_lines())
    # the five steps' labels and the fitted symbols were found
    assert {"shape", "power law", "forecast", "gamma", "alpha", "rich"} <= terms
    missing = _missing(terms)
    assert not missing, f"docs/glossary.md lacks nqfjax fit's {missing}"


def test_predict_prints_only_glossary_terms(monkeypatch, capsys, tmp_path):
    prediction = types.SimpleNamespace(
        engine="LVEngine",
        reason="the data share an eigenbasis",
        switch_times=np.array([10.0, 20.0]),
        validity=types.SimpleNamespace(verdict="holds"),
    )
    agreement = types.SimpleNamespace(
        predicted_times=[10.0], measured_times=[11.0], time_errors=[0.1]
    )
    files = {"summary": tmp_path / "p.json", "figure": tmp_path / "p.png"}
    result = types.SimpleNamespace(
        prediction=prediction, agreement=agreement, files=files
    )
    monkeypatch.setattr(experiments, "predict_file", lambda *a, **k: result)
    assert cli.main(["predict", "--dataset", "iris", "--quiet"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    # the first line names the command; the file lines name files
    terms = _printed_terms(
        [line for line in lines[1:] if not line.startswith(("summary:", "figure:"))]
    )
    assert {"switch-on times", "validity", "trained"} <= terms
    missing = _missing(terms)
    assert not missing, f"docs/glossary.md lacks nqfjax predict's {missing}"
