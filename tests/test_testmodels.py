"""Generated test models are real GGUFs: llama.cpp loads them, tokenizes, and decodes greedily."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCH_QUANTS, spec_for
from saem_gguf.cli.main import main
from saem_gguf.testmodels import ARCHS, ModelSpec, Weights, ensure_model, write_model
from saem_gguf.testmodels.vocab import load_vocab

PROMPT = "First, compute 12 + 7. Wait, let me verify the sum."


def greedy_tokens(llama_cpp, path, n: int = 12) -> list[int]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=64, n_threads=2, seed=1,
                          verbose=False)
    try:
        toks = llm.tokenize(PROMPT.encode(), add_bos=False)
        out = []
        for t in llm.generate(toks, top_k=1, temp=0.0, reset=True):
            out.append(t)
            if len(out) == n:
                break
        return out
    finally:
        llm.close()


@pytest.mark.parametrize("arch,quant", ARCH_QUANTS + [("qwen3moe", "q4_k")])
def test_loads_and_greedy_is_deterministic(llama_cpp, arch, quant):
    path = ensure_model(spec_for(arch, quant))
    a = greedy_tokens(llama_cpp, path)
    b = greedy_tokens(llama_cpp, path)
    assert len(a) == 12 and a == b


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gen_model_with_its_defaults_makes_a_model_of_every_arch(llama_cpp, arch, tmp_path):
    """`gen-model --arch A` with no other flag writes a model llama.cpp loads and decodes (the KV
    heads default to the heads where the architecture's generator needs it: deepseek2, olmoe;
    both were refused before)."""
    path = tmp_path / f"{arch}.gguf"
    assert main(["gen-model", "--arch", arch, "-o", str(path)]) == 0
    assert len(greedy_tokens(llama_cpp, path, n=4)) == 4


def test_real_tokenizer_roundtrip(llama_cpp):
    llm = llama_cpp.Llama(model_path=str(ensure_model(spec_for("qwen3moe", "q8_0"))), n_ctx=64,
                          verbose=False)
    try:
        text = "<think>\nAlternatively, try 3 × 4 = 12 (ünïcode).</think>"
        toks = llm.tokenize(text.encode(), add_bos=False, special=True)
        vocab = load_vocab()
        assert vocab.id_of("<think>") in toks and vocab.id_of("</think>") in toks
        assert len(toks) < len(text.encode())  # real merges, not bytes
        assert llm.detokenize(toks).decode() == text
        tpl = llm.metadata.get("tokenizer.chat_template", "")
        assert "<|im_start|>" in tpl
    finally:
        llm.close()


def test_generation_is_seed_deterministic(tmp_path):
    spec = ModelSpec(arch="qwen2moe", expert_type="q4_0", seed=11)
    a = write_model(spec, tmp_path / "a.gguf").read_bytes()
    b = write_model(spec, tmp_path / "b.gguf").read_bytes()
    c = write_model(ModelSpec(arch="qwen2moe", expert_type="q4_0", seed=12), tmp_path / "c.gguf")
    assert a == b and a != c.read_bytes()


def test_planted_routing_sends_groups_to_their_experts():
    spec = ModelSpec(arch="qwen3moe", n_expert=16, n_expert_used=4, n_layer=3, seed=5,
                     planted=((("verify", "check"), 2),))
    vocab = load_vocab()
    W = Weights(spec, vocab)
    emb = W.embedding()
    x = emb / np.sqrt((emb**2).mean(axis=1, keepdims=True))  # RMSNorm, as the layer input sees it
    for il in range(spec.n_layer):
        logits = x @ W.router(il).T
        top = np.argsort(-logits, axis=1)[:, : spec.n_expert_used]
        want = np.stack([np.sort(W.group_experts(il, g)) for g in W.token_group])
        agree = (np.sort(top, axis=1) == want).all(axis=1).mean()
        assert agree > 0.99, (il, agree)
    verify = [i for i, t in enumerate(vocab.tokens) if t.replace("Ġ", "").lower() in ("verify", "check")]
    assert verify and all(W.token_group[i] == 2 for i in verify)
    # each layer routes a group to a different expert set
    assert not np.array_equal(W.group_experts(0, 2), W.group_experts(1, 2))


def test_expert_pool_copies_experts_and_stage_plant_groups_words(tmp_path):
    from gguf import GGUFReader

    from saem_gguf.testmodels import STAGE_PLANT

    spec = ModelSpec(arch="qwen3moe", expert_type="q4_0", n_expert=16, n_expert_used=2,
                     expert_pool=3, planted=STAGE_PLANT, seed=4)
    path = write_model(spec, tmp_path / "pool.gguf")
    t = next(x for x in GGUFReader(path).tensors if x.name == "blk.0.ffn_up_exps.weight")
    rows = {bytes(np.asarray(t.data[e]).tobytes()) for e in range(spec.n_expert)}
    assert len(rows) == 3  # 16 experts, 3 distinct
    W = Weights(spec, load_vocab())
    vocab = load_vocab()
    check = [i for i, s in enumerate(vocab.tokens) if s.replace("Ġ", "").lower() in ("verify", "check")]
    total = [i for i, s in enumerate(vocab.tokens) if s.replace("Ġ", "").lower() in ("final", "result", "total")]
    assert {int(W.token_group[i]) for i in check} == {1}
    assert {int(W.token_group[i]) for i in total} == {3}


def test_down_experts_take_their_own_type(tmp_path):
    """down_expert_type: the down experts in another type (as Q4_K_M files hold some in Q6_K)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFReader

    path = write_model(ModelSpec(expert_type="q4_0", down_expert_type="q8_0"), tmp_path / "mixed.gguf")
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors if "_exps" in t.name}
    assert types and all(t == (QT.Q8_0 if "down" in n else QT.Q4_0) for n, t in types.items()), types
    with pytest.raises(ValueError, match="down_expert_type"):
        ModelSpec(down_expert_type="q5_0")
    with pytest.raises(ValueError, match="q4_k block size"):
        ModelSpec(n_embd=64, down_expert_type="q4_k")


def test_a_fim_model_has_qwen_coders_fim_tokens_as_llama_cpp_finds_them(llama_cpp):
    """``ModelSpec(fim=True)`` (gen-model --fim): the six tokens after the special ones, each found
    by llama.cpp by its text as in a Qwen-Coder GGUF; the pad, repository and file tokens end a
    generation there."""
    base, fim = load_vocab(), load_vocab(fim=True)
    assert fim.tokens[:base.size] == base.tokens and fim.size % 64 == 0
    llm = llama_cpp.Llama(model_path=str(ensure_model(ModelSpec(fim=True))), n_ctx=64, verbose=False)
    try:
        v = llm._model.vocab
        found = {name: getattr(llama_cpp, f"llama_vocab_fim_{name}")(v)
                 for name in ("pre", "suf", "mid", "pad", "rep", "sep")}
        assert {k: fim.tokens[t] for k, t in found.items()} == {
            "pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>", "pad": "<|fim_pad|>",
            "rep": "<|repo_name|>", "sep": "<|file_sep|>"}
        assert [bool(llama_cpp.llama_vocab_is_eog(v, found[k])) for k in ("mid", "pad", "rep", "sep")] == \
            [False, True, True, True]
    finally:
        llm.close()
