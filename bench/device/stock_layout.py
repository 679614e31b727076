"""Where stock llama.cpp puts experts it runs on the CPU (``-ot exps=CPU``, ``--n-cpu-moe``), by the
model buffers its own loader names, with every layer offloaded (as ``--n-cpu-moe`` leaves them).

    python bench/device/stock_layout.py [--dir DIR]

Why: docs/NATIVE.md ("Not done / limits") says, from the vendored source, that with a GPU those
experts go to the GPU's host buffer type (``CUDA_Host``; under mmap the plain CPU buffer,
``CPU_Mapped``) and never to ``CPU_REPACK`` unless ``--no-host``, so they run and round as the
engine's plain host experts do; without a GPU they go to ``CPU_REPACK`` where the CPU repacks
their type (Q4_0 on AVX2). run.sh writes these lines into env.txt, so the device says which.
The loads go through the patched library, whose loader differs from stock's only for the engine's
own override (patch 0008), not used here.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.llama_lib import load_llama_cpp  # noqa: E402
from saem_gguf.tensor_overrides import TensorOverride, override_array, resolve  # noqa: E402
from saem_gguf.testmodels.spec import ModelSpec  # noqa: E402
from saem_gguf.testmodels.writer import write_model  # noqa: E402


def model_buffers(lc, path: Path, mmap: bool, no_host: bool, log: list[str]) -> list[str]:
    """The "<buffer> model buffer size" lines llama.cpp logs (into ``log``, which its log callback
    fills) loading ``path`` with the experts overridden to the CPU buffer type and every layer
    offloaded; ``mmap`` off as --no-mmap, ``no_host`` as --no-host."""
    log.clear()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = -1
    if not mmap:
        mp.load_mode = 0  # LLAMA_LOAD_MODE_NONE: --no-mmap
    mp.no_host = no_host  # llama.cpp's --no-host
    keep = override_array(resolve(lc, [TensorOverride("_exps", "CPU")]))  # read while loading
    mp.tensor_buft_overrides = ctypes.cast(keep, ctypes.c_void_p)
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        return ["(the model did not load)"]
    lc.llama_model_free(model)
    return [line.split(":", 1)[-1].strip() for line in "".join(log).splitlines() if "model buffer size" in line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="where the tiny model is written (a temporary folder)")
    args = ap.parse_args()
    lc = load_llama_cpp()
    log: list[str] = []
    cb = lc.llama_log_callback(lambda level, text, user: log.append(text.decode(errors="replace")))
    lc.llama_log_set(cb, ctypes.c_void_p(0))
    spec = ModelSpec(arch="qwen3moe", expert_type="q4_0", n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8,
                     n_expert_used=2, name="stock-layout")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = write_model(spec, Path(tmp) / "stock-layout.gguf")
        print(f"gpu offload: {bool(lc.llama_supports_gpu_offload())}")
        for mmap, no_host, flags in ((True, False, ""), (False, False, " --no-mmap"), (True, True, " --no-host")):
            print(f"-ot _exps=CPU{flags}: " + "; ".join(model_buffers(lc, path, mmap, no_host, log)))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
