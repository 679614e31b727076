"""The reference side of the fidelity tests: STOCK llama-cpp-python on the STOCK llama.cpp build.

Run as a subprocess with LLAMA_CPP_LIB_PATH set to the unpatched build's lib dir; it never imports
saem_gguf (one libllama per process). Reads a JSON job on stdin, prints JSON results:

    {"model": PATH, "n_ctx": N, "no_repack": BOOL (optional: llama.cpp's -nr), "cases": [
        {"kind": "completion", "prompt": TEXT, "max_tokens": N, "temperature": T, "seed": S,
         "stop": [TEXT, ...], "grammar": GBNF, "json_schema": TEXT, "logit_bias": [[ID, BIAS], ...]},
        {"kind": "chat", "system": TEXT|null, "turns": [TEXT, ...], "max_tokens": N},
        {"kind": "logits", "prompt_tokens": [ID, ...], "then": [ID, ...]}]}

Each result holds, per call, the prompt tokens create_completion / create_chat_completion handed
to ``Llama.generate`` and the text and finish_reason they returned; a "logits" case evaluates its
prompt in one call and each token of "then" in one call each, and returns the logits after each
call (float32 values, exact in JSON). A chat's turns run on one
``Llama`` (its history grows with each answer, as a chat client does); every case gets a fresh one.
"""

from __future__ import annotations

import json
import sys

import llama_cpp


class RecordingLlama(llama_cpp.Llama):
    """Stock ``Llama`` that notes the prompt tokens each completion starts generating from."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []

    def generate(self, tokens, *args, **kwargs):
        self.prompts.append([int(t) for t in tokens])
        return super().generate(tokens, *args, **kwargs)


def run_case(model: str, n_ctx: int, case: dict) -> dict:
    # "model": more Llama arguments (kv_overrides, ...)
    llm = RecordingLlama(model_path=model, n_ctx=n_ctx, n_threads=2, verbose=False, **case.get("model", {}))
    calls = []
    try:
        if case["kind"] == "logits":
            logits = []
            for chunk in [case["prompt_tokens"]] + [[t] for t in case["then"]]:
                llm.eval(chunk)  # Llama.scores is only written with logits_all: llama.cpp's own
                row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
                logits.append([float(row[i]) for i in range(llm.n_vocab())])
            calls.append({"logits": logits})
        elif case["kind"] == "completion":
            grammar = None  # llama-cpp-python's own: its chain, its JSON schema converter
            if case.get("grammar"):
                grammar = llama_cpp.LlamaGrammar.from_string(case["grammar"], verbose=False)
            elif case.get("json_schema"):
                grammar = llama_cpp.LlamaGrammar.from_json_schema(case["json_schema"], verbose=False)
            r = llm.create_completion(case["prompt"], max_tokens=case["max_tokens"],
                                      temperature=case.get("temperature", 0.0), seed=case.get("seed"),
                                      stop=case.get("stop", []), grammar=grammar,
                                      logit_bias={int(t): float(b) for t, b in case.get("logit_bias", [])} or None,
                                      **case.get("sampling", {}))  # top_p, min_p, typical_p, top_k, ...
            c = r["choices"][0]
            calls.append({"prompt_tokens": llm.prompts[-1], "text": c["text"],
                          "finish_reason": c["finish_reason"]})
        else:
            messages = [{"role": "system", "content": case["system"]}] if case.get("system") else []
            for user in case["turns"]:
                messages.append({"role": "user", "content": user})
                r = llm.create_chat_completion(messages, max_tokens=case["max_tokens"], temperature=0.0)
                c = r["choices"][0]
                calls.append({"prompt_tokens": llm.prompts[-1], "text": c["message"]["content"],
                              "finish_reason": c["finish_reason"]})
                messages.append({"role": "assistant", "content": c["message"]["content"]})
    finally:
        llm.close()
    return {"library": llama_cpp.llama_cpp._base_path.as_posix(), "calls": calls}


def main() -> None:
    job = json.load(sys.stdin)
    if job.get("no_repack"):
        # llama.cpp's -nr, which llama-cpp-python's Llama cannot express: Llama starts its model
        # params from these defaults (llama_cpp/llama.py calls them through llama_cpp.llama_cpp)
        default_params = llama_cpp.llama_cpp.llama_model_default_params

        def no_repack_params():
            p = default_params()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_cpp.llama_model_default_params = no_repack_params
    json.dump([run_case(job["model"], job["n_ctx"], c) for c in job["cases"]], sys.stdout)


if __name__ == "__main__":
    main()
