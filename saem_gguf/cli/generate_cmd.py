"""`generate -m MODEL -p PROMPT`: one shot, streamed to stdout; `--json` for text, ids, timings, stats."""

from __future__ import annotations

import argparse
import json
import sys

from saem_gguf.cli.common import (add_chat_args, add_llama_sampler_args, add_model_args, add_placement_args,
                                  add_prompt_args, add_sampling_args, prompt_arg, sampling_config)
from saem_gguf.cli.engine_args import open_engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate text for one prompt with stage-aware expert placement. The "
                                   "prompt is tokenized as llama.cpp does (BOS when the GGUF asks for it); "
                                   "special-token text in it stays plain text unless --parse-special.")
    add_model_args(p)
    add_prompt_args(p, required=True, what="prompt")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template as a user turn (its text stays "
                        "literal: no control tokens from it)")
    p.add_argument("--parse-special", action="store_true",
                   help="raw prompts: turn special-token text (<|im_start|>, ...) into those tokens, as "
                        "llama.cpp does")
    p.add_argument("--json", action="store_true",
                   help="print JSON: text, token ids, finish_reason, seed, timings, stats")
    p.add_argument("--verbose-prompt", action="store_true",
                   help="print the prompt, its token count and each token (id -> 'piece') on stderr before "
                        "generating, as llama.cpp's --verbose-prompt")
    add_chat_args(p)
    add_sampling_args(p)
    add_llama_sampler_args(p)
    p.add_argument("--no-warmup", action="store_true",
                   help="accepted for llama.cpp's command lines: generate runs no warm-up decode")
    add_placement_args(p)
    p.set_defaults(func=run)


def _print_prompt(eng, prompt, parse_special: bool) -> None:
    """llama.cpp's --verbose-prompt lines (tools/completion): the prompt, its token count, and each
    token as ``id -> 'piece'`` (common_token_to_piece: control tokens' text included), as bytes."""
    from saem_gguf.detokenize import token_piece
    from saem_gguf.engine import ChatPrompt

    text, tokens = (prompt.text, prompt.tokens) if isinstance(prompt, ChatPrompt) else \
        (prompt, eng.prompt_tokens(prompt, parse_special))
    vocab = eng.llm._model.vocab
    out = [f"prompt: '{text}'\n".encode("utf-8"), f"number of tokens in prompt = {len(tokens)}\n".encode()]
    out += [f"{t:6d} -> '".encode() + token_piece(eng._llama_cpp, vocab, t, True) + b"'\n" for t in tokens]
    sys.stderr.flush()
    sys.stderr.buffer.write(b"".join(out))
    sys.stderr.buffer.flush()


def run(args: argparse.Namespace) -> int:
    from saem_gguf.errors import UsageError

    if not args.chat and (args.system is not None or args.chat_template is not None):
        raise UsageError("-sys and --chat-template apply to a chat prompt: add --chat")
    if args.chat and args.parse_special:
        raise UsageError("--parse-special is for raw prompts; with --chat the template's markup is "
                         "parsed and the message stays literal")
    prompt_text = prompt_arg(args)
    sampling = sampling_config(args)
    eng = open_engine(args)
    try:
        prompt = prompt_text
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
            prompt = eng.chat_prompt(messages + [{"role": "user", "content": prompt_text}])
        elif not args.quiet and eng.llm.metadata.get("tokenizer.chat_template"):
            # a chat model continues raw text as text (the embedded model then writes nonsense)
            print("[saem] the prompt goes in as raw text; --chat wraps it in the model's chat template",
                  file=sys.stderr)
        if args.verbose_prompt:
            _print_prompt(eng, prompt, args.parse_special)
        stream = None if args.json else (lambda b: (sys.stdout.buffer.write(b), sys.stdout.flush()))
        try:
            res = eng.generate(prompt, args.n_predict, sampling, on_piece=stream,
                               parse_special=args.parse_special)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        if args.json:
            out = {"text": res.text, "tokens": res.tokens, "finish_reason": res.finish_reason,
                   "seed": res.seed, "prompt_tokens": res.prompt_token_ids, "n_prompt": res.prompt_tokens,
                   "n_generated": len(res.tokens),
                   "timings": {"prompt_s": round(res.seconds_prompt, 4),
                               "decode_s": round(res.seconds_decode, 4),
                               "tokens_per_s": round(res.tokens_per_s, 2)},
                   "stage_events": [{"token": e.token, "source": e.source, "cue": e.cue}
                                    for e in res.events],
                   "experts": eng.stats(), "notes": eng.notes}
            print(json.dumps(out, indent=2))
        else:
            sys.stdout.write("\n")
            if not args.quiet:
                s = eng.stats()
                print(f"[saem] {len(res.tokens)} tokens ({res.finish_reason}), {res.tokens_per_s:.1f} t/s"
                      + (f", hit rate {s['hit_rate']:.1%}, {s['bytes_moved'] / 1e6:.2f} MB moved, "
                         f"{s['boundaries']} stage boundaries" if "hit_rate" in s else ""),
                      file=sys.stderr)
    finally:
        eng.close()
    return 0
