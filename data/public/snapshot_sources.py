"""Copy published data files from a local git clone into ``sources/<source>/`` and record their provenance.

Not part of ``build.py``: it documents how the copies under ``sources/`` were taken (and retakes them), so a
reader can check every file against its repository. Usage::

    python data/public/snapshot_sources.py SOURCE GIT_DIR REPO [--history PATHSPEC] [COMMIT:PATH ...]

``--history PATHSPEC`` copies every version of every JSON file under PATHSPEC that any commit added or modified
(each measured run is kept, not only the newest); ``COMMIT:PATH`` copies one file at one commit. The manifest
``sources/<source>/MANIFEST.json`` lists repo, commit, path, local file and sha256 for each copy.
Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _git(git_dir: str, *args: str) -> bytes:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True).stdout


def _history(git_dir: str, pathspec: str) -> list[tuple[str, str]]:
    commits = _git(git_dir, "log", "--format=%H", "--", pathspec).decode().split()
    found = []
    for commit in reversed(commits):
        names = _git(git_dir, "diff-tree", "--no-commit-id", "--name-only", "-r", "--diff-filter=AM", commit,
                     "--", pathspec).decode().split()
        found += [(commit, name) for name in names if name.endswith(".json")]
    return found


def snapshot(source: str, git_dir: str, repo: str, items: list[tuple[str, str]]) -> Path:
    root = HERE / "sources" / source
    manifest_path = root / "MANIFEST.json"
    entries = {e["file"]: e for e in (json.loads(manifest_path.read_text())["files"]
                                      if manifest_path.exists() else [])}
    for commit, path in items:
        blob = _git(git_dir, "show", f"{commit}:{path}")
        local = Path(commit[:12]) / path
        (root / local).parent.mkdir(parents=True, exist_ok=True)
        (root / local).write_bytes(blob)
        entries[str(local)] = {"repo": repo, "commit": commit, "path": path, "file": str(local),
                               "sha256": hashlib.sha256(blob).hexdigest()}
    manifest = {"source": source, "repo": repo, "files": [entries[k] for k in sorted(entries)]}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("git_dir")
    parser.add_argument("repo")
    parser.add_argument("--history", metavar="PATHSPEC")
    parser.add_argument("items", nargs="*", metavar="COMMIT:PATH")
    args = parser.parse_args()
    items = _history(args.git_dir, args.history) if args.history else []
    items += [tuple(item.split(":", 1)) for item in args.items]
    print(snapshot(args.source, args.git_dir, args.repo, items))


if __name__ == "__main__":
    main()
