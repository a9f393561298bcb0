"""An earlier revision of ``dora_torch``, importable beside the working tree's, for A/Bs in one
process.

Batch-1 steps of one code spread by 10-25% between processes on the lent machines
(benchmarks/NOTES.md, sessions 16-19), so a change is judged against the code before it in
the same process (``bench_step_interleaved --rev DIR`` adds the variant ``ours_rev``). This
writes ``git archive REV dora_torch`` under DIR as the package ``dora_torch_rev``, every
``dora_torch`` in its sources renamed, so the two packages share no module, logger or
``torch.library`` namespace. Both register torch's global optimizer-step hook, so every
variant's step runs both hooks (the same cost for all variants).

    python3 -m benchmarks.revision_copy HEAD --dest .rev          # here, where git is
    python3 -m benchmarks.bench_step_interleaved --rev .rev ...   # on the device (carry .rev)
"""

from __future__ import annotations

import argparse
import io
import pathlib
import shutil
import subprocess
import tarfile

PACKAGE = "dora_torch"
#: The copy's package name.
REV_PACKAGE = "dora_torch_rev"


def write_copy(rev: str, dest: pathlib.Path, repo: pathlib.Path | None = None) -> str:
    """Write ``rev``'s package into ``dest`` (replaced) as ``REV_PACKAGE``; returns the
    commit's short hash, also written to ``dest/REVISION``."""
    repo = repo or pathlib.Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(repo)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short", f"{rev}^{{commit}}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    archive = subprocess.run(
        [*git, "archive", "--format=tar", commit, PACKAGE], check=True, capture_output=True
    ).stdout
    if dest.exists():
        shutil.rmtree(dest)
    target = dest / REV_PACKAGE
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            rel = pathlib.PurePosixPath(member.name).relative_to(PACKAGE)
            data = tar.extractfile(member).read()
            if rel.suffix == ".py":
                data = data.decode().replace(PACKAGE, REV_PACKAGE).encode()
            out = target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
    (dest / "REVISION").write_text(commit + "\n")
    return commit


def load(dest: pathlib.Path):
    """Import the copy written by ``write_copy`` under ``dest``: (package, commit)."""
    import importlib
    import sys

    dest = pathlib.Path(dest).resolve()
    if not (dest / REV_PACKAGE / "__init__.py").is_file():
        raise FileNotFoundError(
            f"{dest} holds no {REV_PACKAGE}: write it with "
            f"`python3 -m benchmarks.revision_copy REV --dest {dest}`"
        )
    if str(dest) not in sys.path:
        sys.path.insert(0, str(dest))
    return importlib.import_module(REV_PACKAGE), (dest / "REVISION").read_text().strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="a git revision, e.g. HEAD or a commit hash")
    ap.add_argument("--dest", default=".rev", help="directory to write (replaced)")
    args = ap.parse_args(argv)
    commit = write_copy(args.rev, pathlib.Path(args.dest))
    print(f"{PACKAGE} at {commit} written to {args.dest}/{REV_PACKAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
