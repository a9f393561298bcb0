"""Every result file the READMEs cite by run (a backticked name with ``run<N>`` in it, braces
expanded) exists in ``benchmarks/results``: a number in the READMEs must come from the file of
the run it cites."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("README.md", "benchmarks/README.md")
_SUFFIX = re.compile(r"\.(csv|log|png|txt|gz|tgz|json)$")


def expand(token: str) -> list[str]:
    """Shell-style brace expansion of one token: ``a{,_b}.{csv,log}`` -> four names."""
    m = re.search(r"\{([^{}]*)\}", token)
    if m is None:
        return [token]
    out = []
    for alt in m.group(1).split(","):
        out += expand(token[: m.start()] + alt + token[m.end() :])
    return out


def cited(text: str) -> set[str]:
    """File names (no directory) of the run results a document cites."""
    names = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        for name in expand(token):
            name = name.rsplit("/", 1)[-1]
            if _SUFFIX.search(name) and re.search(r"run\d", name) and "*" not in name:
                names.add(name)
    return names


def test_expand_follows_the_shell():
    assert expand("a{,_b}_run1.{csv,log}") == ["a_run1.csv", "a_run1.log", "a_b_run1.csv",
                                                "a_b_run1.log"]  # fmt: skip
    assert cited("`results/x_run3.{csv,log}` and `out.csv`, `y_run4.png`") == {
        "x_run3.csv", "x_run3.log", "y_run4.png"}  # fmt: skip


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_run_file_exists(doc):
    have = {p.name for p in RESULTS.rglob("*") if p.is_file()}
    missing = sorted(cited((ROOT / doc).read_text()) - have)
    assert not missing, f"{doc} cites result files that benchmarks/results does not hold: {missing}"
