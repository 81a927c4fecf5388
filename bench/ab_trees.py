"""The trees of a side-by-side bench run (`--base REV` or `--ab-env VAR=VALUE`), and the order their rounds take.

    with ab_trees(root, base, ab_env, "serve_bench") as trees:     # {label: (tree root, extra env)}
        for r, label in alternating(rounds, trees):
            ...run one round of the bench in a child process with trees[label]...

`--base REV`: REV checked out as a detached git worktree in the temp folder (reused if there, removed after the run:
a worktree is registered in the repository), beside this tree. `--ab-env VAR=VALUE`: this tree with and without the
setting. Neither: this tree alone. Rounds alternate the order (A B, B A, ...) so neither side always runs first on a
box whose speed drifts (bench/RESULTS.md: one stream moved 131-168 tok/s within 76 s)."""
from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def ab_trees(root: Path, base: str | None, ab_env: str | None, prefix: str) -> Iterator[dict[str, tuple[Path, dict]]]:
    if base:
        sha = subprocess.check_output(["git", "-C", str(root), "rev-parse", base], text=True).strip()
        path = Path(tempfile.gettempdir()) / f"{prefix}_{sha[:12]}"
        if not path.exists():
            subprocess.check_call(["git", "-C", str(root), "worktree", "add", "--detach", str(path), sha],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield {f"base {base}": (path, {}), "this": (root, {})}
        finally:
            subprocess.call(["git", "-C", str(root), "worktree", "remove", "--force", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif ab_env:
        # VAR=VALUE, or several: A=1,B=0
        yield {ab_env: (root, dict(kv.partition("=")[::2] for kv in ab_env.split(","))), "this": (root, {})}
    else:
        yield {"this": (root, {})}


def alternating(rounds: int, trees: dict) -> Iterator[tuple[int, str]]:
    """(round, label) for every round and tree, the order reversed every other round."""
    for r in range(rounds):
        for t in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            yield r, t


def round_env(tree: Path, extra: dict, **more: str) -> dict:
    """A round's environment: this process's, PYTHONPATH the tree first, then what the caller's PYTHONPATH holds (the
    H200 image's packages live in /tmp/site there), and the tree's extra setting."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **more, **extra)
