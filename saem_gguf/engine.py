"""The engine: a GGUF opened on the patched llama.cpp with stage-aware expert placement attached.

``Engine`` validates the model file first (clear errors, no llama.cpp crash on a bad file), pins
CPU threads per ``--numa``, loads the model through llama-cpp-python (``SaemLlama``, a ``Llama``
subclass, so ``create_completion`` / ``create_chat_completion`` / streaming keep working), sizes
the expert cache (``--ecr`` or ``--vram-budget``), and hooks every decode: routing is read from
the native counters, fed with the token's text to the stage detector, and the policy's
residency changes are issued as async expert copies before the next decode.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TextIO

import numpy as np

from saem_gguf import numa
from saem_gguf.budget import format_size, plan_from_budget, plan_from_ecr
from saem_gguf.errors import SaemError
from saem_gguf.gguf_info import ModelInfo, read_model_info
from saem_gguf.llama_lib import load_llama_cpp
from saem_gguf.trace import ModelSignature, SequenceTrace

DEFAULT_ECR = 0.25
# architectures whose cue set is more specific than the general one
FAMILY_CUES = {"qwen3moe": "qwen3", "deepseek2": "deepseek-r1", "gpt-oss": "gpt-oss"}
# Policies that rank a stage a cue opens by the profile's per-cue stage routing (saem-cue's blend).
CUE_RANKING_POLICIES = ("saem", "saem-cue")


@dataclass
class EngineConfig:
    model: Path | None = None  # None: the embedded default model
    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = 99
    numa: str = "off"
    policy: str = "saem"
    ecr: float | None = None
    vram_budget: int | None = None
    profile: Path | None = None
    hw: str = "rtx4090-ddr5"  # cost-model preset the policy prices CPU runs vs copies with
    seed: int = 0
    verbose: bool = False
    record: bool = False  # keep a routing trace of what is decoded
    progress: bool = True  # a loading progress bar (on a terminal)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    seconds_prompt: float
    seconds_decode: float
    events: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds_decode if self.seconds_decode > 0 else 0.0


def _with_extra(cues, extra):
    """``cues`` plus the cues of ``extra`` it lacks (saem-cue watches both)."""
    have = {t.casefold() for t in cues.texts}
    extra = extra.subset([t for t in extra.texts if t.casefold() not in have])
    return cues.merged(extra) if len(extra) else cues


def _make_llama_class(llama_cpp):
    class SaemLlama(llama_cpp.Llama):
        """``Llama`` whose every ubatch is followed by the engine's hook (routing -> placement).

        With ``saem_experts_on_host`` the expert tensors load into plain (pinned, with a GPU) host
        memory the native cache can copy from: ``Llama.__init__`` assigns ``self.model_params``
        before loading, and this property's setter amends those params on the way in."""

        def __init__(self, *args, saem_hook: Callable[[list[int]], None] | None = None,
                     saem_experts_on_host: bool = False, saem_progress: TextIO | None = None, **kw):
            self._saem_hook = None
            self._saem_on_host = saem_experts_on_host
            self._saem_bar = None
            if saem_progress is not None:
                from tqdm import tqdm

                self._saem_bar = tqdm(total=100, desc="loading", unit="%", file=saem_progress,
                                      bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")
            try:
                super().__init__(*args, **kw)
            finally:
                if self._saem_bar is not None:
                    self._saem_bar.close()
            self._saem_hook = saem_hook

        @property
        def model_params(self):
            return self._saem_model_params

        @model_params.setter
        def model_params(self, params) -> None:
            if self._saem_on_host:
                from saem_gguf import native_api as na

                # keep the override array alive as long as the model
                self._saem_buft_override = na.keep_experts_on_host(params, pinned=True)
            if self._saem_bar is not None:
                bar = self._saem_bar

                def progress(p: float, _ud) -> bool:
                    bar.n = int(p * 100)
                    bar.refresh()
                    return True

                # kept on self: the C side calls it for as long as the model loads
                self._saem_progress_cb = llama_cpp.llama_progress_callback(progress)
                params.progress_callback = self._saem_progress_cb
            self._saem_model_params = params

        def eval(self, tokens):
            hook = self._saem_hook
            if hook is None:
                return super().eval(tokens)
            tokens = list(tokens)
            # one decode call per ubatch, so each ubatch's routing is read before the next
            for i in range(0, len(tokens), self.n_batch):
                chunk = tokens[i:i + self.n_batch]
                super().eval(chunk)
                hook(chunk)

    return SaemLlama


class Engine:
    def __init__(self, cfg: EngineConfig, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.notes: list[str] = []
        self._log = log or (lambda s: None)
        path = cfg.model
        if path is None:
            from saem_gguf.default_model import default_model_path

            path = default_model_path()
        self.info: ModelInfo = read_model_info(path)
        self.path = Path(path)
        if cfg.ecr is not None and cfg.vram_budget is not None:
            raise SaemError("give --ecr or --vram-budget, not both")
        self.numa_plan = numa.plan(cfg.numa)
        numa.apply(self.numa_plan)
        self.note(f"NUMA: {self.numa_plan.note}")
        llama_cpp = load_llama_cpp()
        self._llama_cpp = llama_cpp
        self.placement = None
        self.policy_name = "off"
        slots = self._slots_per_layer()
        n_threads = cfg.n_threads or max(1, len(self.numa_plan.cpus))
        Cls = _make_llama_class(llama_cpp)
        # the bar writes to a duplicate of fd 2, taken before llama.cpp's log silences fd 2
        bar_out = os.fdopen(os.dup(2), "w") if cfg.progress and sys.stderr.isatty() else None
        try:
            with _quiet_stderr(not cfg.verbose):
                self.llm = Cls(
                    model_path=str(self.path), n_ctx=cfg.n_ctx, n_batch=512, n_ubatch=512,
                    n_threads=n_threads, n_threads_batch=n_threads, n_gpu_layers=cfg.n_gpu_layers,
                    seed=cfg.seed, verbose=cfg.verbose,
                    # tracing wants every prompt token's routing in the last layer too, which
                    # llama.cpp computes only for tokens whose logits are requested
                    logits_all=cfg.record,
                    # first-touch puts the weights on the pinned node when they are read, not mapped
                    use_mmap=self.numa_plan.node is None,
                    numa=self.numa_plan.llama_strategy, saem_hook=None,
                    saem_progress=bar_out,
                    saem_experts_on_host=slots is not None)
        except ValueError as e:
            raise SaemError(f"llama.cpp could not load {self.path}: {e}") from None
        finally:
            if bar_out is not None:
                bar_out.close()
        self._in_prompt = False
        self._seq_prompt_tokens = 0
        self._pieces: list[bytes] = []
        self._trace_tokens: list[int] = []
        if slots is not None:
            self._attach_placement(slots)
        self.llm._saem_hook = self._on_ubatch

    # --- setup -------------------------------------------------------------------------------
    def note(self, msg: str) -> None:
        self.notes.append(msg)
        self._log(msg)

    def _slots_per_layer(self) -> int | None:
        info, cfg = self.info, self.cfg
        if not info.is_moe:
            self.note(f"{info.architecture} is a dense model: expert management is off "
                      f"(--policy {cfg.policy} has nothing to place)")
            return None
        if cfg.vram_budget is not None:
            plan = plan_from_budget(info, cfg.vram_budget, cfg.n_ctx)
        else:
            plan = plan_from_ecr(info, DEFAULT_ECR if cfg.ecr is None else cfg.ecr, cfg.n_ctx)
        self.cache_plan = plan
        self.note(f"expert cache: {plan.slots_per_layer}/{info.n_expert} slots per layer "
                  f"(ECR {plan.ecr:.1%}, {format_size(plan.cache_bytes)})"
                  + (f"; {plan.note}" if plan.note else ""))
        return plan.slots_per_layer

    def _attach_placement(self, slots: int) -> None:
        from saem_gguf import native_api as na

        try:
            self.set_placement(self.cfg.policy, slots)
        except na.UnsupportedModelError as e:
            self.note(f"expert management is off: {e}")
            self.placement = None

    def set_placement(self, policy: str, slots: int) -> None:
        """(Re)attach placement: ``policy`` over ``slots`` cache slots per MoE layer. The native
        cache is re-initialised; the model stays loaded (bench switches policies this way)."""
        from saem_gguf.costmodel import CostModel, get_hw
        from saem_gguf.placement import Placement

        if policy == "oracle":
            raise SaemError("the oracle policy needs the future routing: use it with `simulate` on "
                            "a trace, not on a live model")
        if not self.info.is_moe:
            raise SaemError(f"{self.info.architecture} is a dense model: no experts to place")
        detector, calib, cue_counts = self._make_detector(policy)
        cost = CostModel.from_expert_bytes(self.info.moe_layers[0].bytes_per_expert, get_hw(self.cfg.hw))
        self.placement = None
        self.placement = Placement(self.llm.ctx, policy, slots, cost, detector,
                                   calib_counts=calib, cue_counts=cue_counts, record=self.cfg.record)
        self.policy_name = policy
        self.note(f"policy {policy}: {self.placement.policy.summary}")
        if policy == "saem-cue" and not cue_counts:
            self.note("saem-cue has no cue profiles (make them with `calibrate` and pass --profile): "
                      "it ranks like saem")

    def _make_detector(self, policy: str):
        """(stage detector, calibration counts or None, per-cue stage counts or None).

        With ``--profile``: the profile's detector and statistics. On the embedded model without
        one: the family cue detector (short stages) and the packaged profile's statistics only.
        Under the policies that rank by cue profiles (saem, saem-cue) the detector also watches
        the cues the profile holds stage routing for."""
        import dataclasses

        from saem_gguf.stage.calibrate import Profile
        from saem_gguf.stage.cues import CueSet
        from saem_gguf.stage.detector import DetectorConfig, StageDetector

        info = self.info
        path = self.cfg.profile
        if path is None and self.cfg.model is None:
            from saem_gguf.default_model import default_profile_path

            path = default_profile_path()
        prof = Profile.load(path, expect=self.signature()) if path is not None else None
        calib = cue_counts = extra = None
        if prof is not None:
            where = f"profile {path}"
            counts = prof.stats.get("expert_counts")
            calib = np.asarray(counts, np.float64) if counts is not None else None
            if calib is not None and calib.shape != (len(info.moe_layers), info.n_expert):
                raise SaemError(f"{where}: expert_counts shape {calib.shape} does not match the model")
            profiles = prof.stats.get("cue_profiles")
            if policy in CUE_RANKING_POLICIES and profiles is not None:
                from saem_gguf.policies.cue_profiles import from_json

                if not isinstance(profiles, dict) or not {"cues", "counts"} <= set(profiles):
                    raise SaemError(f"{where}: cue_profiles must hold 'cues' and 'counts'")
                cue_counts = from_json(profiles["counts"], len(info.moe_layers), info.n_expert, where=where)
                extra = CueSet.from_dict(profiles["cues"], where=where, allow_empty=True)
        shape = dict(n_layer=len(info.moe_layers), n_expert=info.n_expert, top_k=info.n_expert_used)
        if self.cfg.profile is not None:
            if extra is not None:
                prof = dataclasses.replace(prof, cues=_with_extra(prof.cues, extra))
            return StageDetector.from_profile(prof, 1), calib, cue_counts
        cues = CueSet.load(FAMILY_CUES.get(info.architecture, "general"))
        if extra is not None:
            cues = _with_extra(cues, extra)
        # the embedded model's stages are short (median ~19 tokens, docs/DEFAULT_MODEL.md)
        cfg = DetectorConfig(min_stage_tokens=12) if self.cfg.model is None else DetectorConfig()
        return StageDetector(1, cues, cfg, **shape), calib, cue_counts

    # --- the hook ----------------------------------------------------------------------------
    def _on_ubatch(self, tokens: list[int]) -> None:
        p = self.placement
        if self._in_prompt or len(tokens) > 1:
            self._seq_prompt_tokens += len(tokens)
            if p is not None:
                p.on_prompt(len(tokens))
            if self.cfg.record:
                self._trace_tokens.extend(tokens)
                self._pieces.extend(self.piece(t) for t in tokens)
            return
        piece = self.piece(tokens[0])
        if self.cfg.record:
            self._trace_tokens.append(tokens[0])
            self._pieces.append(piece)
        if p is not None:
            p.on_token(piece)

    def piece(self, token: int) -> bytes:
        # not LlamaModel.token_to_piece: it returns its whole 32-byte buffer, NULs included
        return self.llm._model.detokenize([token], special=True)

    # --- generation --------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], n_predict: int = 256, temp: float = 0.0,
               special: bool = True, reuse_prefix: bool = False) -> Iterator[tuple[int, bytes]]:
        """Yield (token, piece) as they are decoded. Greedy at temp 0.

        ``reuse_prefix`` keeps the KV cache of a common prefix with the previous call (chat turns);
        otherwise the whole prompt is evaluated, so prompt timings and traces cover all of it."""
        llm = self.llm
        toks = prompt if isinstance(prompt, list) else llm.tokenize(prompt.encode(), add_bos=False,
                                                                  special=special)
        if not toks:
            raise SaemError("empty prompt")
        if len(toks) + max(n_predict, 0) > llm.n_ctx():
            raise SaemError(f"prompt ({len(toks)} tokens) + -n {n_predict} exceed the context "
                            f"(-c {llm.n_ctx()})")
        self.reset_sequence()
        if not reuse_prefix:
            llm.reset()
        self._in_prompt = True  # evals before the first sampled token are the prompt's
        n = 0
        for tok in llm.generate(toks, top_k=1 if temp <= 0 else 40, temp=temp, reset=True):
            self._in_prompt = False
            if llm._model.token_is_eog(tok) if hasattr(llm._model, "token_is_eog") else tok == llm.token_eos():
                break
            yield tok, self.piece(tok)
            n += 1
            if 0 <= n_predict <= n:
                break

    def generate(self, prompt: str | list[int], n_predict: int = 256, temp: float = 0.0,
                 on_piece: Callable[[bytes], None] | None = None) -> GenerationResult:
        t0 = time.perf_counter()
        out_toks: list[int] = []
        out = bytearray()
        t_first = None
        ev0 = len(self.placement.stats.events) if self.placement else 0
        for tok, piece in self.stream(prompt, n_predict, temp):
            if t_first is None:
                t_first = time.perf_counter()
            out_toks.append(tok)
            out += piece
            if on_piece:
                on_piece(piece)
        t1 = time.perf_counter()
        events = self.placement.stats.events[ev0:] if self.placement else []
        t_first = t_first or t1
        # stream() evaluated the whole prompt (no prefix reuse), so this is its token count
        return GenerationResult(out.decode("utf-8", errors="replace"), out_toks, self._seq_prompt_tokens,
                                t_first - t0, t1 - t_first, list(events))

    def replay(self, prompt: str, continuation: str) -> GenerationResult:
        """Decode ``continuation`` token by token after ``prompt`` (teacher forcing): the same
        one-token decode steps as generation, on text chosen by the caller, so routing follows a
        known reasoning text even on a model that cannot write one. Used by bench --replay."""
        llm = self.llm
        p_toks = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        c_toks = llm.tokenize(continuation.encode(), add_bos=False, special=True)
        if not p_toks or not c_toks:
            raise SaemError("replay needs a non-empty prompt and continuation")
        if len(p_toks) + len(c_toks) > llm.n_ctx():
            raise SaemError(f"replay text ({len(p_toks) + len(c_toks)} tokens) exceeds the context "
                            f"(-c {llm.n_ctx()})")
        self.reset_sequence()
        llm.reset()
        ev0 = len(self.placement.stats.events) if self.placement else 0
        t0 = time.perf_counter()
        self._in_prompt = True
        llm.eval(p_toks)
        self._in_prompt = False
        t1 = time.perf_counter()
        for t in c_toks:
            llm.eval([t])
        t2 = time.perf_counter()
        events = self.placement.stats.events[ev0:] if self.placement else []
        return GenerationResult(continuation, c_toks, len(p_toks), t1 - t0, t2 - t1, list(events))

    def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text the model's own chat template makes of ``messages``."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        tpl = self.llm.metadata.get("tokenizer.chat_template")
        if not tpl:
            raise SaemError(f"{self.path} has no chat template (tokenizer.chat_template)")
        fmt = Jinja2ChatFormatter(template=tpl, eos_token="", bos_token="")
        return fmt(messages=messages).prompt

    def reset_sequence(self) -> None:
        self._seq_prompt_tokens = 0
        if self.placement is not None:
            self.placement.reset_sequence()
        self._pieces.clear()
        self._trace_tokens.clear()
        if self.placement is not None:
            self.placement.trace_experts.clear()

    def stats(self) -> dict:
        d = {"model": str(self.path), "architecture": self.info.architecture,
             "policy": self.policy_name if self.placement else "off"}
        if self.placement is not None:
            d.update(self.placement.stats.to_dict())
            d["slots_per_layer"] = int(self.placement.state.n_slots.max(initial=0))
            d["ecr"] = d["slots_per_layer"] / self.info.n_expert
        return d

    def sequence_trace(self) -> SequenceTrace:
        """The routing trace of the last ``stream``/``generate`` call (EngineConfig.record)."""
        if not self.cfg.record or self.placement is None:
            raise SaemError("tracing needs record=True and a MoE model with expert management on")
        experts = np.concatenate(self.placement.trace_experts, axis=0)
        T = len(self._trace_tokens)
        experts = experts[:T]
        starts = sorted({0} | {e.token for e in self.placement.stats.events if e.token < T})
        return SequenceTrace(token_ids=np.asarray(self._trace_tokens, np.int32), pieces=list(self._pieces),
                             experts=experts, stage_starts=np.asarray(starts, np.int32),
                             prompt_len=min(self._seq_prompt_tokens, T))

    def signature(self) -> ModelSignature:
        i = self.info
        return ModelSignature(arch=i.architecture, n_layer=len(i.moe_layers), n_expert=i.n_expert,
                              n_expert_used=i.n_expert_used,
                              expert_bytes=i.moe_layers[0].bytes_per_expert if i.is_moe else 0,
                              name=i.name)

    def close(self) -> None:
        self.llm.close()


@contextlib.contextmanager
def _quiet_stderr(enabled: bool):
    """llama.cpp logs to fd 2 from C; silence it unless --verbose."""
    if not enabled:
        yield
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as dn:
            os.dup2(dn.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
