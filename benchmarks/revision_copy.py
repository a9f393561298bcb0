"""An earlier revision of ``dora_torch`` or ``dora_jax``, importable beside the working tree's,
for A/Bs in one process.

Batch-1 steps of one code spread by 10-25% between processes on the lent machines
(benchmarks/NOTES.md, sessions 16-19), so a change is judged against the code before it in
the same process (``bench_step_interleaved --rev DIR`` adds the variant ``ours_rev``;
``ab_jax --rev DIR`` does the same for dora_jax). This writes ``git archive REV PACKAGE``
under DIR as the package ``PACKAGE_rev``, every ``PACKAGE`` in its sources renamed, so the two
packages share no module, logger or ``torch.library`` namespace. Both torch packages register
torch's global optimizer-step hook, so every variant's step runs both hooks (the same cost for
all variants).

    python3 -m benchmarks.revision_copy HEAD --dest .rev          # here, where git is
    python3 -m benchmarks.bench_step_interleaved --rev .rev ...   # on the device (carry .rev)
    python3 -m benchmarks.revision_copy HEAD --package dora_jax --dest .rev_jax
"""

from __future__ import annotations

import argparse
import io
import pathlib
import shutil
import subprocess
import tarfile

#: The packages a copy can be made of; the first is the default.
PACKAGES = ("dora_torch", "dora_jax")
PACKAGE = PACKAGES[0]


def rev_name(package: str) -> str:
    """The copy's package name: ``package`` + "_rev"."""
    if package not in PACKAGES:
        raise ValueError(f"package must be one of {PACKAGES}; got {package!r}")
    return package + "_rev"


#: The torch copy's package name.
REV_PACKAGE = rev_name(PACKAGE)


def write_copy(
    rev: str, dest: pathlib.Path, repo: pathlib.Path | None = None, *, package: str = PACKAGE
) -> str:
    """Write ``rev``'s ``package`` into ``dest`` (replaced) as ``rev_name(package)``; returns
    the commit's short hash, also written to ``dest/REVISION``."""
    rev_package = rev_name(package)
    repo = repo or pathlib.Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(repo)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short", f"{rev}^{{commit}}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    archive = subprocess.run(
        [*git, "archive", "--format=tar", commit, package], check=True, capture_output=True
    ).stdout
    if dest.exists():
        shutil.rmtree(dest)
    target = dest / rev_package
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            rel = pathlib.PurePosixPath(member.name).relative_to(package)
            data = tar.extractfile(member).read()
            if rel.suffix == ".py":
                data = data.decode().replace(package, rev_package).encode()
            out = target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
    (dest / "REVISION").write_text(commit + "\n")
    return commit


def load(dest: pathlib.Path, *, package: str = PACKAGE):
    """Import the copy of ``package`` written by ``write_copy`` under ``dest``:
    (module, commit)."""
    import importlib
    import sys

    rev_package = rev_name(package)
    dest = pathlib.Path(dest).resolve()
    if not (dest / rev_package / "__init__.py").is_file():
        raise FileNotFoundError(
            f"{dest} holds no {rev_package}: write it with "
            f"`python3 -m benchmarks.revision_copy REV --package {package} --dest {dest}`"
        )
    if str(dest) not in sys.path:
        sys.path.insert(0, str(dest))
    return importlib.import_module(rev_package), (dest / "REVISION").read_text().strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="a git revision, e.g. HEAD or a commit hash")
    ap.add_argument("--package", default=PACKAGE, choices=PACKAGES, help="which package")
    ap.add_argument("--dest", default=".rev", help="directory to write (replaced)")
    args = ap.parse_args(argv)
    commit = write_copy(args.rev, pathlib.Path(args.dest), package=args.package)
    print(f"{args.package} at {commit} written to {args.dest}/{rev_name(args.package)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
