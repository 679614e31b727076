"""`generate -m MODEL -p PROMPT`: one shot, streamed to stdout; `--json` for text, ids, timings, stats."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from saem_gguf.cli.common import (add_chat_args, add_llama_sampler_args, add_model_args, add_placement_args,
                                  add_sampling_args, process_escapes, sampling_config)
from saem_gguf.cli.engine_args import open_engine
from saem_gguf.errors import SaemError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate text for one prompt with stage-aware expert placement. The "
                                   "prompt is tokenized as llama.cpp does (BOS when the GGUF asks for it); "
                                   "special-token text in it stays plain text unless --parse-special.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", type=Path, metavar="FNAME",
                     help="a file containing the prompt (one trailing newline dropped, as llama.cpp)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template as a user turn (its text stays "
                        "literal: no control tokens from it)")
    p.add_argument("--parse-special", action="store_true",
                   help="raw prompts: turn special-token text (<|im_start|>, ...) into those tokens, as "
                        "llama.cpp does")
    p.add_argument("--json", action="store_true",
                   help="print JSON: text, token ids, finish_reason, seed, timings, stats")
    add_chat_args(p)
    add_sampling_args(p)
    add_llama_sampler_args(p)
    p.add_argument("--no-warmup", action="store_true",
                   help="accepted for llama.cpp's command lines: generate runs no warm-up decode")
    add_placement_args(p)
    p.set_defaults(func=run)


def _utf8_arg(text: str, flag: str) -> str:
    """``text`` from the command line; bytes that are not UTF-8 arrive as lone surrogates
    (Python's surrogateescape) and cannot be tokenized, so they are refused here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SaemError(f"{flag} is not valid UTF-8 (byte 0x{ord(text[e.start]) & 0xFF:02x} at "
                        f"position {e.start})") from None
    return text


def _prompt_text(args: argparse.Namespace) -> str:
    if args.system is not None:
        _utf8_arg(args.system, "-sys/--system-prompt")
    if args.prompt is not None:
        text = _utf8_arg(args.prompt, "-p/--prompt")
    else:
        try:
            text = args.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SaemError(f"cannot read the prompt file {args.file}: {e}") from None
        text = text[:-1] if text.endswith("\n") else text
    # llama.cpp processes the escapes of a prompt read with -f too: it is the same prompt string
    return process_escapes(text, "-p/--prompt" if args.prompt is not None else f"-f {args.file}") if args.escape \
        else text


def run(args: argparse.Namespace) -> int:
    from saem_gguf.errors import UsageError

    if not args.chat and (args.system is not None or args.chat_template is not None):
        raise UsageError("-sys and --chat-template apply to a chat prompt: add --chat")
    if args.chat and args.parse_special:
        raise UsageError("--parse-special is for raw prompts; with --chat the template's markup is "
                         "parsed and the message stays literal")
    prompt_text = _prompt_text(args)
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
