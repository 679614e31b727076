#!/usr/bin/env python3
"""Regenerate patches/*.patch from an edited llama.cpp tree (developer tool, not used by the build).

    python native/tools/mkpatches.py --tree /tmp/native-dev/llama.cpp --pristine <unpatched tree>

The tree must be a git repository whose HEAD is the pristine source. Its working-tree diff is split
into one patch per concern (CONCERNS below: files, and for files shared by two concerns, a hunk
predicate), each re-diffed after applying the previous ones so line numbers are exact, and written
keeping the header text (what and why) already in front of each patch file.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (patch name, {file: hunk predicate or None for every hunk})
CONCERNS = [
    ("0001-ggml-mul-mat-id-skip-flag", {"ggml/include/ggml.h": None, "ggml/src/ggml.c": None}),
    ("0002-ggml-cpu-mul-mat-id-skip-negative-ids", {"ggml/src/ggml-cpu/ggml-cpu.c": None,
                                                   "ggml/src/ggml-cpu/ggml-cpu.cpp": None,
                                                   "ggml/src/ggml-cpu/repack.cpp": None}),
    ("0003-ggml-cuda-mul-mat-id-flags-unsupported", {"ggml/src/ggml-cuda/ggml-cuda.cu": lambda h: "event_query" not in h}),
    ("0004-ggml-backend-event-query", {"ggml/include/ggml-backend.h": None, "ggml/src/ggml-backend-impl.h": None,
                                      "ggml/src/ggml-backend.cpp": None,
                                      "ggml/src/ggml-cuda/ggml-cuda.cu": lambda h: "event_query" in h}),
    ("0005-llama-graph-moe-branches", {"src/llama-graph.h": None, "src/llama-graph.cpp": None}),
    ("0006-llama-context-moe-cache-hooks", {"src/llama-context.h": None, "src/llama-context.cpp": None}),
    # 0007 (CUDA mmvq/mmq) was written by hand after this tool: its ggml-cuda.cu hunks would also
    # match 0003's predicate, so the tool cannot split a tree that holds both
    ("0008-llama-model-loader-plain-cpu-override", {"src/llama-model-loader.cpp": None}),
]


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout


def split_hunks(diff: str) -> tuple[str, list[str]]:
    """(file header, hunks) of a single-file diff."""
    parts = re.split(r"(?m)^(?=@@ )", diff)
    return parts[0], parts[1:]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "patches")
    args = ap.parse_args()
    tree = args.tree.resolve()
    all_files = {f for _, fs in CONCERNS for f in fs}
    changed = set(git(tree, "diff", "--name-only").split())
    untracked = set(git(tree, "ls-files", "--others", "--exclude-standard").split())
    if changed - all_files or untracked:
        raise SystemExit(f"files not assigned to a concern: {sorted((changed - all_files) | untracked)}")

    with tempfile.TemporaryDirectory() as td:
        work = Path(td) / "llama.cpp"
        subprocess.run(["git", "clone", "-q", str(tree), str(work)], check=True)
        for name, files in CONCERNS:
            pieces = []
            for f, pred in files.items():
                d = git(tree, "diff", "--", f)
                if not d:
                    continue
                head, hunks = split_hunks(d)
                sel = [h for h in hunks if pred is None or pred(h)]
                if sel:
                    pieces.append(head + "".join(sel))
            partial = "".join(pieces)
            if not partial:
                raise SystemExit(f"{name}: empty")
            subprocess.run(["patch", "-p1", "--batch", "--quiet"], input=partial, text=True, cwd=work, check=True)
            exact = git(work, "diff")
            git(work, "-c", "user.email=x@y", "-c", "user.name=mkpatches", "commit", "-qam", name)
            old = args.out / f"{name}.patch"
            header = old.read_text().split("\ndiff --git", 1)[0] if old.exists() else ""
            if not header.strip() or header.startswith("diff --git"):
                raise SystemExit(f"{old}: write its header (what and why) first")
            (args.out / f"{name}.patch").write_text(header.rstrip("\n") + "\n\n" + exact)
            print(f"{name}.patch: {exact.count(chr(10))} lines")
        # the concerns together must reproduce the tree exactly
        for f in all_files:
            if (work / f).read_bytes() != (tree / f).read_bytes():
                raise SystemExit(f"split mismatch in {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
