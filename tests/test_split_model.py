"""A model split into parts (llama.cpp's gguf-split naming: PREFIX-00001-of-00003.gguf, the
layout of the large MoE GGUFs people download): given its first part, it is read, checked and
loaded whole, as llama.cpp loads it, and answers as the unsplit file does; a part given alone, a
part missing or a part that says it is another is one line."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from bad_inputs_data import rewrite_gguf
from conftest import REPO, run_cli
from saem_gguf.default_model import default_model_path
from saem_gguf.gguf_info import read_model_info

PARTS = 3


def write_split(src: Path, dst: Path, parts: int) -> list[Path]:
    """``src`` rewritten as ``parts`` files by gguf-py's writer (the split keys llama.cpp reads)."""
    per = math.ceil(len(gguf.GGUFReader(src).tensors) / parts)
    rewrite_gguf(src, dst, {}, split_max_tensors=per)
    return [dst.with_name(f"{dst.stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> list[Path]:
    paths = write_split(default_model_path(), tmp_path_factory.mktemp("split") / "model.gguf", PARTS)
    assert all(p.exists() for p in paths)
    return paths


def test_a_split_model_reads_as_the_whole_file(split):
    whole, parts = read_model_info(default_model_path(), for_load=True), read_model_info(split[0], for_load=True)
    assert {**vars(parts), "path": "", "file_bytes": 0} == {**vars(whole), "path": "", "file_bytes": 0}
    assert parts.file_bytes == sum(p.stat().st_size for p in split)
    assert len({t.name for layer in parts.moe_layers for t in layer.tensors}) == 3 * parts.n_layer


def _generate(model: Path, *flags: str) -> dict:
    r = run_cli("generate", "-m", str(model), "-p", "What is 12 + 7?", "-n", "24", "--json", *flags, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("flags", [[], ["--policy", "lru", "--ecr", "0.25"]], ids=["saem", "lru"])
def test_a_split_model_answers_as_the_whole_file(split, flags):
    ours, whole = _generate(split[0], *flags), _generate(default_model_path(), *flags)
    assert ours["text"] == whole["text"] and ours["n_generated"] == 24


def _one_line_error(*args: str) -> str:
    r = run_cli(*args)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_a_later_part_alone_is_one_line(split):
    assert "part 2 of a model split in 3: give its first part" in _one_line_error("inspect", str(split[1]))


def test_a_missing_part_is_one_line(split, tmp_path):
    shutil.copy(split[0], tmp_path / split[0].name)
    shutil.copy(split[1], tmp_path / split[1].name)
    line = _one_line_error("generate", "-m", str(tmp_path / split[0].name), "-p", "x", "-n", "2")
    assert "part 3 of this split model is missing" in line and split[2].name in line


def test_a_first_part_renamed_is_one_line(split, tmp_path):
    renamed = tmp_path / "model.gguf"
    shutil.copy(split[0], renamed)
    assert "must be named PREFIX-00001-of-00003.gguf" in _one_line_error("inspect", str(renamed))


def test_parts_in_the_wrong_places_are_one_line(split, tmp_path):
    for i, j in ((0, 0), (1, 2), (2, 1)):
        shutil.copy(split[j], tmp_path / split[i].name)
    line = _one_line_error("inspect", str(tmp_path / split[0].name))
    assert "says it is part 3" in line and "expected part 2" in line


def test_experts_llama_cpp_loads_elsewhere_than_the_file_says_stop_the_engine(split):
    """The engine places the expert tensors by the layers it read in the file; where llama.cpp
    loads experts in others (a split model read from its first part alone, before), the expert
    cache is not started on that: one SaemError, not a SIGSEGV (run apart, in case it is one)."""
    script = (
        "import sys\n"
        "import saem_gguf.gguf_info as gi\n"
        "from saem_gguf.engine import Engine, EngineConfig\n"
        "from saem_gguf.errors import SaemError\n"
        "gi._other_parts = lambda path, reader: []  # the first part alone, as before\n"
        "try:\n"
        f"    Engine(EngineConfig(model=gi.Path({str(split[0])!r}), n_ctx=256, n_threads=1, verbose=False))\n"
        "except SaemError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "llama.cpp loaded experts in layers [0, 1, 2, 3, 4, 5]" in r.stdout, r.stdout
