"""The engine end to end on real generated models: placement never changes results, and the
commands behave for a user (scripted chat, --json, clear errors)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, run_cli, spec_for
from saem_gguf.engine import Engine, EngineConfig
from saem_gguf.simulator import calibration_sample
from saem_gguf.stage.calibrate import Profile
from saem_gguf.testmodels import ensure_model
from saem_gguf.trace import load_traces

PROMPT = "First, compute 12 + 7. Wait, let me verify the sum. Alternatively, count up from 12."
POLICIES = ["cpu-moe", "n-cpu-moe", "static-hot", "lru", "lfu", "temporal", "saem", "saem-implicit", "saem-cue",
            "gpu-all"]


def greedy(eng: Engine, n: int = 20) -> tuple[list[int], np.ndarray]:
    res = eng.generate(PROMPT, n)
    # the logits of the last decode, read from the context: without logits_all llama-cpp-python
    # (0.3.x) never fills Llama.scores, an uninitialised np.ndarray (comparing it was a flake)
    llama_cpp = eng._llama_cpp
    ptr = llama_cpp.llama_get_logits_ith(eng.llm.ctx, -1)
    assert ptr, "no logits for the last decode"
    last = np.ctypeslib.as_array(ptr, shape=(eng.llm.n_vocab(),)).copy()
    return res.tokens, last


@pytest.fixture(scope="module")
def qwen3_path(llama_cpp):
    return ensure_model(spec_for("qwen3moe", "q4_0", n_expert=16, n_expert_used=4, n_layer=3, seed=2))


@pytest.fixture(scope="module")
def reference(qwen3_path):
    eng = Engine(EngineConfig(model=qwen3_path, n_ctx=256, policy="cpu-moe", ecr=0.0, n_threads=2))
    try:
        return greedy(eng)
    finally:
        eng.close()


FAST = [("saem", 0.25), ("lru", 0.125), ("static-hot", 0.5), ("gpu-all", 0.25)]
FULL = [pytest.param(p, e, marks=pytest.mark.slow) for p in POLICIES for e in (0.125, 0.5)
        if (p, e) not in FAST]


@pytest.mark.parametrize("policy,ecr", FAST + FULL)
def test_greedy_output_identical_for_every_policy_and_ecr(qwen3_path, reference, policy, ecr):
    eng = Engine(EngineConfig(model=qwen3_path, n_ctx=256, policy=policy, ecr=ecr, n_threads=2))
    try:
        toks, last = greedy(eng)
        st = eng.stats()
    finally:
        eng.close()
    assert toks == reference[0]
    assert np.array_equal(last, reference[1])  # bit-exact logits on CPU
    assert st["tokens"] > 0 and st["expert_accesses"] == st["tokens"] * 3 * 4
    if policy == "gpu-all":
        assert st["hit_rate"] == 1.0


def test_policy_switch_in_one_process_keeps_results(qwen3_path, reference):
    eng = Engine(EngineConfig(model=qwen3_path, n_ctx=256, policy="saem", ecr=0.25, n_threads=2))
    try:
        for pol, slots in (("lru", 2), ("saem", 8), ("cpu-moe", 0), ("gpu-all", 16)):
            eng.set_placement(pol, slots)
            assert greedy(eng)[0] == reference[0]
    finally:
        eng.close()


def test_the_decode_steps_kernels_are_bound_to_the_routing_sink(qwen3_path, reference):
    """A decode step's detector, link meter and policy kernels are called through their compiled
    entry points (kernel_books.entry_point), bound once per placement to the one-token view of
    the native routing sink that every decode refills; the tokens stay the reference's."""
    from saem_gguf.policies.adaptive import adaptive_entry
    from saem_gguf.policies.caching import caching_entry
    from saem_gguf.policies.saem import stage_books
    from saem_gguf.stage.matcher import feed_entry

    eng = Engine(EngineConfig(model=qwen3_path, n_ctx=256, policy="saem", ecr=0.25, n_threads=2))
    try:
        for pol, slots, entry in (("saem", 8, adaptive_entry), ("lfu-cpu", 4, caching_entry),
                                  ("saem-cue", 4, stage_books), ("gpu-all", 16, None)):
            eng.set_placement(pol, slots)
            assert greedy(eng)[0] == reference[0]
            pl = eng.placement
            rows = pl._routing_reader.one_token()[0]
            assert pl._bound_rows is rows and rows.shape == (1, 3, 4)
            assert pl.policy._bound_rows is rows if entry is not None else not hasattr(pl.policy, "_bound_rows")
            if entry is not None:
                assert pl.policy._bound_entry is not entry
            if pl.link is not None:
                assert pl.link._bound_rows is rows and pl.link._bound_map is pl._native
            if pl.pair is not None:
                assert pl.pair._bound_rows is rows
            else:
                assert pl.detector.matcher._bound_entry is not feed_entry
    finally:
        eng.close()


def test_policies_price_copies_with_the_native_copy_barrier(qwen3_path, tmp_path):
    """The native layer makes every decode wait for the copies queued before it, so the policies'
    cost model says so whatever the hardware profile (here one without the barrier) says."""
    import dataclasses
    import json

    from saem_gguf.costmodel import HW_PRESETS

    profile = tmp_path / "hw.json"
    profile.write_text(json.dumps(dataclasses.asdict(HW_PRESETS["rtx4090-ddr5"].replace(copy_barrier=False))))
    eng = Engine(EngineConfig(model=qwen3_path, n_ctx=256, policy="saem", ecr=0.25, n_threads=2, hw=str(profile)))
    try:
        cost = eng.placement.policy.ctx.cost
        assert cost.hw.copy_barrier and cost.hw.h2d_bw == HW_PRESETS["rtx4090-ddr5"].h2d_bw
    finally:
        eng.close()


def test_static_hot_without_calibration_says_it_places_nothing(qwen3_path):
    eng = Engine(EngineConfig(model=qwen3_path, n_ctx=256, policy="static-hot", ecr=0.5, n_threads=2))
    try:
        assert any("static-hot has no calibration counts" in n for n in eng.notes)
        assert (eng.placement.state.slot_of < 0).all()
    finally:
        eng.close()


def test_stats_report_the_budget_and_an_uneven_layout(qwen3_path):
    """n-cpu-moe puts the budget's bytes in whole layers: the stats give the mean slots per layer
    and the ECR actually held (not the largest layer's) and the layout. The test model has 3 MoE
    layers of 16 experts: ECR 50 % is 24 slots, one whole layer fits, the rest is unused."""
    eng = Engine(EngineConfig(model=qwen3_path, n_ctx=256, policy="n-cpu-moe", ecr=0.5, n_threads=2))
    try:
        st = eng.stats()
        layout = st["slot_layout"]
        assert layout == [0, 0, 16]  # llama.cpp --n-cpu-moe keeps the first layers on the CPU
        assert st["slots_per_layer"] == 5 and st["ecr"] == pytest.approx(16 / 48)
    finally:
        eng.close()


def test_dense_model_runs_with_management_off(llama_cpp):
    path = ensure_model(spec_for("llama", "f16", dense=True))
    r = run_cli("generate", "-m", str(path), "-p", "Hello", "-n", "4", "--policy", "saem", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["experts"]["policy"] == "off"
    assert "dense model: expert management is off" in r.stderr


def test_generate_json(qwen3_path):
    r = run_cli("generate", "-m", str(qwen3_path), "-p", PROMPT, "-n", "8", "--json", "--policy", "saem",
                "--ecr", "25%")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert len(d["tokens"]) == 8 and d["n_prompt"] > 5
    assert d["experts"]["policy"] == "saem" and d["experts"]["slots_per_layer"] == 4
    assert {"prompt_s", "decode_s", "tokens_per_s"} <= set(d["timings"])
    assert "--chat wraps it" in r.stderr  # a chat model got raw text: say how to wrap it


def test_generate_chat_on_the_embedded_model():
    r = run_cli("generate", "--chat", "-p", "What is 37 + 45?", "-n", "800", "--json")
    assert r.returncode == 0, r.stderr
    assert "--chat wraps it" not in r.stderr
    text = json.loads(r.stdout)["text"]
    assert text.startswith("<think>") and "</think>" in text and text.rstrip().endswith("Answer: 82"), text


def test_chat_scripted_from_stdin(qwen3_path):
    script = "What is 2 + 3?\n/stats\n/reset\nAnd 4 + 4?\n/quit\n"
    r = subprocess.run([sys.executable, "-m", "saem_gguf", "chat", "-m", str(qwen3_path), "-n", "6",
                        "--quiet"], input=script, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "hit rate" in r.stdout and "policy saem" in r.stdout
    assert "[new conversation]" in r.stdout


@pytest.mark.parametrize("argv,needle", [
    (["generate", "-m", "/nonexistent/model.gguf", "-p", "x"], "no such file"),
    (["generate", "-p", "x", "--ecr", "2"], "out of range"),
    (["chat", "--policy", "oracle", "-m", "MODEL"], "oracle"),
])
def test_clear_errors(qwen3_path, argv, needle):
    argv = [str(qwen3_path) if a == "MODEL" else a for a in argv]
    r = run_cli(*argv)
    assert r.returncode in (1, 2), r
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_non_numeric_flag_is_a_usage_error():
    r = run_cli("generate", "-p", "x", "-c", "lots")
    assert r.returncode == 2 and "invalid" in r.stderr and "Traceback" not in r.stderr


def test_pieces_are_the_exact_text_and_cues_across_tokens_are_seen(qwen3_path):
    eng = Engine(EngineConfig(model=qwen3_path, n_ctx=512, policy="saem", ecr=0.25, n_threads=2))
    try:
        toks = eng.llm.tokenize(PROMPT.encode(), add_bos=False)
        assert b"".join(eng.piece(t) for t in toks) == PROMPT.encode()
        steps = " ".join(f"{a} + {a} = {2 * a}." for a in range(10, 15))
        text = f"First, add the numbers. {steps}\nWait, let me verify the last one. {steps}\n" \
               f"Therefore, the answer is 78."
        res = eng.replay("<|im_start|>user\nAdd.<|im_end|>\n<|im_start|>assistant\n<think>\n", text)
        cues = [e.cue for e in res.events if e.source == "cue"]
        assert "Wait" in cues and "Therefore" in cues, res.events
        assert eng.stats()["boundaries"] >= 2
    finally:
        eng.close()


def test_saem_cue_and_saem_with_a_calibrated_profile_on_the_embedded_model(tmp_path):
    """trace -> calibrate -> engine --profile with saem-cue and saem: the profile carries per-cue
    stage routing, saem-cue ranks by it at cue boundaries; it carries a sample of the routing,
    which saem replays at load to choose its layout (and says so); the output equals cpu-moe's."""
    from saem_gguf.defaultmodel import corpus

    prompts = tmp_path / "q.txt"
    prompts.write_text("\n".join(e.question for e in corpus.heldout_examples(40, seed=4242)) + "\n")
    trace, prof = tmp_path / "t.npz", tmp_path / "p.json"
    r = run_cli("trace", "--prompts", str(prompts), "-n", "200", "-o", str(trace), "--quiet")
    assert r.returncode == 0, r.stderr
    r = run_cli("calibrate", "--traces", str(trace), "-o", str(prof), "--min-stage-tokens", "12", "--quiet")
    assert r.returncode == 0, r.stderr
    profiles = json.loads(prof.read_text())["stats"]["cue_profiles"]
    cue_counts = profiles["counts"]
    kept = {c for c, g in profiles["gain"].items() if g["keep"]}
    assert kept and kept <= set(cue_counts)  # some cue's profile beat the previous stage
    assert {c["text"] for c in profiles["cues"]["cues"]} == kept
    sample = Profile.load(prof).routing
    expect = calibration_sample(load_traces(str(trace)))
    assert [s.n_tokens for s in sample.sequences] == [s.n_tokens for s in expect.sequences]
    assert all(np.array_equal(a.experts, b.experts) for a, b in zip(sample.sequences, expect.sequences))

    question = corpus.heldout_examples(1, seed=32)[0].question
    outs = {}
    for policy in ("cpu-moe", "saem-cue", "saem"):
        notes = []
        eng = Engine(EngineConfig(policy=policy, ecr=0.25, n_threads=2, profile=prof if policy != "cpu-moe" else None,
                                  progress=False), log=notes.append)
        try:
            outs[policy] = eng.generate(eng.chat_prompt([{"role": "user", "content": question}]), 200).tokens
            pol = eng.placement.policy
            if policy == "saem-cue":
                assert set(pol.ctx.cue_counts) == set(cue_counts)
                assert "cue" in {reason for _, reason in pol.boundaries}
            if policy == "saem":  # 25 % of 6 x 32 experts: at most 1 whole layer
                assert list(pol.layout_prices) == [0, 1]
                assert any(m.startswith("slot layout: ") for m in notes), notes
                # the leader at start is the rule that led the calibration replay, and it is said
                names = [c for c, _, _ in pol.candidates]
                first = max(names, key=lambda c: (pol.replay_led[c], -names.index(c)))
                assert any(m.startswith(f"saem starts following {first} (it led ") for m in notes), notes
        finally:
            eng.close()
    assert outs["saem-cue"] == outs["cpu-moe"] == outs["saem"]


def test_a_profile_sample_too_short_to_replay_sets_the_layout_statically(tmp_path):
    """A profile whose calibration sample holds fewer decoded tokens than a replay needs
    (simulator.MIN_REPLAY_TOKENS): saem does not replay it, as simulate would not, and the
    engine says why the layout was not replayed; with the packaged profile's whole sample it
    replays (the test above)."""
    from saem_gguf.default_model import default_profile_path
    from saem_gguf.simulator import MIN_REPLAY_TOKENS
    from saem_gguf.stage.calibrate import encode_routing

    packaged = default_profile_path()
    short = calibration_sample(Profile.load(packaged).routing, MIN_REPLAY_TOKENS // 2)
    assert 0 < short.decoded_tokens < MIN_REPLAY_TOKENS
    data = json.loads(packaged.read_text())
    data["stats"]["calibration_routing"] = encode_routing(short)
    prof = tmp_path / "short.json"
    prof.write_text(json.dumps(data))
    notes = []
    eng = Engine(EngineConfig(policy="saem", ecr=0.25, n_threads=2, profile=prof, progress=False), log=notes.append)
    try:
        pol = eng.placement.policy
        assert pol.replays_its_layout and pol.layout_prices == {} and not pol.replay_led
        assert not any(m.startswith("slot layout: ") for m in notes), notes
        said = [m for m in notes if "too few to replay" in m]
        assert len(said) == 1 and f"holds {short.decoded_tokens} decoded tokens" in said[0], notes
    finally:
        eng.close()
