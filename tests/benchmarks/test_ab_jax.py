"""``benchmarks/ab_jax``: one-process A/B of dora_jax against an earlier revision's copy
(``revision_copy --package dora_jax``), on the CPU with tiny programs."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

import dora_jax
from benchmarks import ab_jax
from benchmarks.revision_copy import load, rev_name, write_copy

REPO = pathlib.Path(__file__).resolve().parents[2]


def _git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return probe.returncode == 0


needs_git = pytest.mark.skipif(not _git_checkout(), reason="needs a git checkout")


@pytest.fixture(scope="module")
def rev_dir(tmp_path_factory):
    dest = tmp_path_factory.mktemp("rev_jax")
    write_copy("HEAD", dest, package="dora_jax")
    return dest


def test_layer_names_parse_and_bad_ones_name_the_flag():
    assert ab_jax.parse_layer("8192x28672_r384_t2048") == (8192, 28672, 384, 2048)
    with pytest.raises(ValueError, match="--layer"):
        ab_jax.parse_layer("8192x8192_r384")


def test_a_bad_layer_fails_before_the_copy_is_read(tmp_path):
    with pytest.raises(ValueError, match="--layer"):
        ab_jax.main(["--rev", str(tmp_path / "absent"), "--layer", "big"])


def test_the_copy_package_must_be_known():
    assert rev_name("dora_jax") == "dora_jax_rev"
    with pytest.raises(ValueError, match="package"):
        rev_name("dora")


def test_shape_differences_cover_both_programs_largest_first():
    tree = {("fusion", "kLoop", "a"): 10.0, ("dot", "", "b"): 5.0}
    rev = {("fusion", "kLoop", "a"): 4.0, ("fusion", "kInput", "c"): 2.0}
    rows = ab_jax.shape_differences(tree, rev)
    assert rows[0] == (("fusion", "kLoop", "a"), 10.0, 4.0)
    assert [row[0][2] for row in rows] == ["a", "b", "c"]
    assert rows[2] == (("fusion", "kInput", "c"), 0.0, 2.0)


@needs_git
def test_the_jax_copy_is_a_separate_package_with_its_revisions_math(rev_dir):
    sources = list((rev_dir / "dora_jax_rev").rglob("*.py"))
    assert sources
    for path in sources:
        assert "dora_jax" not in path.read_text().replace("dora_jax_rev", "")
    rev, _ = load(rev_dir, package="dora_jax")
    assert rev.DoraDense is not dora_jax.DoraDense
    ks = jax.random.split(jax.random.key(0), 5)
    x, k = jax.random.normal(ks[0], (8, 24)), jax.random.normal(ks[1], (24, 16))
    a, b = jax.random.normal(ks[2], (24, 4)), jax.random.normal(ks[3], (4, 16))
    m = jnp.abs(jax.random.normal(ks[4], (16,))) + 0.5
    ours = dora_jax.functional.dora_dense(x, k, a, b, m, 2.0, impl="xla")
    theirs = rev.functional.dora_dense(x, k, a, b, m, 2.0, impl="xla")
    assert jnp.array_equal(ours, theirs)  # CI runs on the committed tree: HEAD's math


@needs_git
def test_a_layer_ab_times_both_variants_and_profiles_them(rev_dir, tmp_path):
    out = ab_jax.main(
        ["--rev", str(rev_dir), "--layer", "64x48_r4_t16", "--kind", "grad", "--rounds", "2",
         "--calls", "1", "--profile", "--profile-steps", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    assert set(out["times"]) == {"tree", "rev"}
    assert all(len(ts) == 2 and min(ts) > 0 for ts in out["times"].values())
    for by_shape in out["profile"].values():  # the dots of the VJP are found in both programs
        assert any(opcode == "dot" for opcode, _, _ in by_shape) and min(by_shape.values()) >= 0
    assert (tmp_path / "ab_jax.csv").is_file() and (tmp_path / "ab_jax_profile.csv").is_file()
    assert all(ab_jax.unlabelled_share(v) < 0.5 for v in out["profile"].values())


def test_unlabelled_time_is_the_share_on_ops_the_hlo_does_not_name():
    unknown = tuple(ab_jax.UNKNOWN_OP.values())
    assert ab_jax.unlabelled_share({unknown: 3.0, ("dot", "", "f32[4]"): 1.0}) == 0.75
    assert ab_jax.unlabelled_share({("dot", "", "f32[4]"): 1.0}) == 0.0
    assert ab_jax.unlabelled_share({}) == 0.0


@needs_git
def test_a_model_ab_runs_the_training_step_of_each_package(rev_dir):
    out = ab_jax.main(
        ["--rev", str(rev_dir), "--model", "4", "1", "--tiny", "--rounds", "1", "--calls", "1"]
    )
    assert set(out["times"]) == {"tree", "rev"} and "profile" not in out


@needs_git
def test_a_layer_kind_other_than_fwd_or_grad_is_refused(rev_dir):
    with pytest.raises(ValueError, match="--kind"):
        ab_jax.main(["--rev", str(rev_dir), "--layer", "64x48_r4_t16", "--kind", "bwd"])
