"""``benchmarks/revision_copy``: an earlier revision of dora_torch importable beside the tree's
(renamed package and torch.library namespace), for A/Bs in one process."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import torch
from torch import nn

import dora_torch
from benchmarks.revision_copy import PACKAGE, REV_PACKAGE, load, write_copy

REPO = pathlib.Path(__file__).resolve().parents[2]


def _git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _git_checkout(), reason="needs a git checkout of the repository")
def test_the_copy_is_a_separate_package_that_computes_what_its_revision_did(tmp_path):
    commit = write_copy("HEAD", tmp_path / "rev")
    sources = list((tmp_path / "rev" / REV_PACKAGE).rglob("*.py"))
    assert sources and (tmp_path / "rev" / "REVISION").read_text().strip() == commit
    for path in sources:  # nothing of the copy resolves to the tree's package
        assert PACKAGE not in path.read_text().replace(REV_PACKAGE, "")
    rev, got_commit = load(tmp_path / "rev")
    assert got_commit == commit and rev.__name__ == REV_PACKAGE
    assert rev.Linear is not dora_torch.Linear
    assert hasattr(torch.ops, REV_PACKAGE)  # its own torch.library namespace
    # The same layer through both packages: at HEAD the forward is the tree's eager forward
    # (this test runs on the committed tree in CI).
    torch.manual_seed(0)
    lin = nn.Linear(24, 16)
    ours = dora_torch.Linear.from_linear(lin, r=4, lora_alpha=8, impl="eager")
    with torch.no_grad():
        ours.lora_B.normal_()  # B = 0 at init would leave only the base product to compare
    theirs = rev.Linear.from_linear(lin, r=4, lora_alpha=8, impl="eager")
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, 24)
    torch.testing.assert_close(theirs(x), ours(x), rtol=0, atol=0)


def test_loading_a_directory_without_a_copy_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"benchmarks\.revision_copy"):
        load(tmp_path)
