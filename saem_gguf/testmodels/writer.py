"""Writes a test model to a real GGUF file that llama.cpp loads."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import gguf
import numpy as np

from saem_gguf.build.paths import cache_root
from saem_gguf.fileio import atomic_output
from saem_gguf.testmodels.archs import get_arch
from saem_gguf.testmodels.quant import quantize
from saem_gguf.testmodels.spec import ModelSpec
from saem_gguf.testmodels.vocab import CHAT_TEMPLATES, CHATML_TEMPLATE, Vocab, load_vocab
from saem_gguf.testmodels.weights import PooledExperts, Weights

GENERATOR_VERSION = 3  # bump when the bytes written for a given spec change

FILE_TYPE = {"f16": 1, "q8_0": 7, "q4_0": 2, "q4_k": 15}  # llama_ftype of the expert tensors


def random_tensors(spec: ModelSpec, vocab: Vocab) -> Iterator[tuple[str, np.ndarray, str]]:
    """The random (planted-routing) tensors of a test model, in file order."""
    arch = get_arch(spec.arch)
    W = Weights(spec, vocab)
    out: list[tuple[str, np.ndarray, str]] = [("token_embd.weight", W.embedding(), "f16")]
    for il in range(spec.n_layer):
        arch.layer(lambda n, a, k: out.append((n, a, k)), W, il)
    out.append(("output_norm.weight", W.norm_weight(spec.n_embd), "f32"))
    out.append(("output.weight", W.normal(vocab.size, spec.n_embd), "f16"))
    return iter(out)


def write_model(spec: ModelSpec, path: Path) -> Path:
    """A random test model for ``spec``."""
    vocab = load_vocab(spec.fim, harmony=spec.chat_template == "gpt-oss")
    return write_gguf(path, spec, vocab, random_tensors(spec, vocab),
                      chat_template=CHAT_TEMPLATES[spec.chat_template])


def write_gguf(path: Path, spec: ModelSpec, vocab: Vocab,
               tensors: Iterable[tuple[str, np.ndarray, str]], *, name: str | None = None,
               description: str = "saem_gguf generated test model (random weights, planted routing)",
               chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Write ``tensors`` ((name, float32 array in NumPy order, kind) with kind "f32" | "f16" = the
    spec's matrix type | "expert" = the spec's expert type) with the spec's hyperparameters and
    ``vocab``."""
    arch = get_arch(spec.arch)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temporary file renamed into place when complete: a crash, Ctrl-C or SIGTERM never leaves a
    # truncated model behind (in the cache or at -o)
    with atomic_output(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch.name)
        try:
            _write_metadata(w, spec, arch, vocab, name or spec.name or f"saem-test-{spec.arch}",
                            description, chat_template)
            for tname, arr, kind in tensors:
                qkind = {"expert": spec.expert_type, "f16": spec.matrix_type}.get(kind, kind)
                if kind == "expert" and spec.down_expert_type and "ffn_down_exps" in tname:
                    qkind = spec.down_expert_type
                if isinstance(arr, PooledExperts):
                    data, qt = quantize(arr.pool, qkind)
                    data = np.ascontiguousarray(data[arr.index])
                else:
                    data, qt = quantize(arr, qkind)
                if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                    w.add_tensor(tname, data)
                else:
                    w.add_tensor(tname, data, raw_shape=data.shape, raw_dtype=qt)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    return path


def _write_metadata(w: gguf.GGUFWriter, spec: ModelSpec, arch, vocab: Vocab, name: str,
                    description: str, chat_template: str | None) -> None:
    w.add_name(name)
    w.add_description(description)
    w.add_file_type(1 if spec.dense else FILE_TYPE[spec.expert_type])
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(arch.feed_forward_length(spec))
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if not spec.dense:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
    # the planted routing, so tests and tools can check what routing should be
    w.add_uint32("saem.seed", spec.seed)
    w.add_uint32("saem.generator_version", GENERATOR_VERSION)
    arch.hparams(w, spec)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.token_types))
    w.add_token_merges(list(vocab.merges))
    w.add_eos_token_id(vocab.eos_id)
    gemma = spec.chat_template == "gemma"
    w.add_bos_token_id(vocab.id_of("<bos>" if gemma else "<|endoftext|>"))
    if gemma:
        w.add_eot_token_id(vocab.id_of("<end_of_turn>"))
    w.add_pad_token_id(vocab.id_of("<|endoftext|>"))
    w.add_add_bos_token(spec.add_bos_token)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def model_cache_dir() -> Path:
    return cache_root() / "models"


def ensure_model(spec: ModelSpec, cache_dir: Path | None = None) -> Path:
    """Path of the GGUF for ``spec``, generating it once into the cache (outside git)."""
    path = Path(cache_dir or model_cache_dir()) / spec.filename()
    if not path.exists():
        write_model(spec, path)
    return path
