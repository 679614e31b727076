"""`generate -m MODEL -p PROMPT`: one shot, streamed to stdout; `--json` for text, ids, timings, stats."""

from __future__ import annotations

import argparse
import json
import sys

from saem_gguf.cli.common import add_model_args, add_placement_args, add_sampling_args
from saem_gguf.cli.engine_args import open_engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate text for one prompt with stage-aware expert placement.")
    add_model_args(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--json", action="store_true", help="print JSON: text, token ids, timings, stats")
    add_sampling_args(p)
    add_placement_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    eng = open_engine(args)
    try:
        prompt = args.prompt
        if args.chat:
            prompt = eng.chat_prompt([{"role": "user", "content": prompt}])
        elif not args.quiet and eng.llm.metadata.get("tokenizer.chat_template"):
            # a chat model continues raw text as text (the embedded model then writes nonsense)
            print("[saem] the prompt goes in as raw text; --chat wraps it in the model's chat template",
                  file=sys.stderr)
        stream = None if args.json else (lambda b: (sys.stdout.buffer.write(b), sys.stdout.flush()))
        try:
            res = eng.generate(prompt, args.n_predict, args.temp, on_piece=stream)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        if args.json:
            out = {"text": res.text, "tokens": res.tokens, "n_prompt": res.prompt_tokens,
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
                print(f"[saem] {len(res.tokens)} tokens, {res.tokens_per_s:.1f} t/s"
                      + (f", hit rate {s['hit_rate']:.1%}, {s['bytes_moved'] / 1e6:.2f} MB moved, "
                         f"{s['boundaries']} stage boundaries" if "hit_rate" in s else ""),
                      file=sys.stderr)
    finally:
        eng.close()
    return 0

