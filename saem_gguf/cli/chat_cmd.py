"""`chat [-m MODEL]`: interactive, streaming chat (the embedded default model without -m)."""

from __future__ import annotations

import argparse

from saem_gguf.chat import ChatSession, run_repl
from saem_gguf.cli.common import (add_chat_args, add_llama_sampler_args, add_model_args, add_placement_args,
                                  add_prompt_args, add_sampling_args, on_off_auto, prompt_arg, sampling_config)
from saem_gguf.cli.engine_args import open_engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat (default: the embedded model)",
                       description="Chat with a MoE GGUF using stage-aware expert placement. Commands: "
                                   "/stats, llama-cli's /clear, /regen, /read FILE, /glob PATTERN, /exit "
                                   "(also /reset, /quit). Ctrl-C stops the current answer. On a terminal "
                                   "lines are edited and recalled with readline (history in the cache "
                                   "dir's chat_history, last 1000 lines) and <think>...</think> is dimmed "
                                   "(not with NO_COLOR set). When stdin is not a terminal, each line is "
                                   "one user turn. A conversation longer than -c loses its oldest turns "
                                   "(the system prompt stays).")
    add_model_args(p)
    add_prompt_args(p, required=False, what="first user message (llama-cli's: sent before any input is read)")
    p.add_argument("-st", "--single-turn", action="store_true",
                   help="end the chat after one answer (llama-cli's); with -p or -f no input is read")
    add_chat_args(p)
    p.add_argument("--show-stages", action="store_true",
                   help="mark stage boundaries in the output, each before the cue that opened it")
    p.add_argument("--hide-thinking", action="store_true",
                   help="fold <think>...</think> into one line saying how much was hidden")
    p.add_argument("-co", "--color", type=on_off_auto, default="auto", metavar="on|off|auto",
                   help="dim the thinking (llama-cli's flag): on, off, or auto (default: on a terminal, unless "
                        "NO_COLOR is set)")
    p.add_argument("--show-timings", action=argparse.BooleanOptionalAction, default=True,
                   help="after each answer, llama-cli's line of prompt and generation speed in tokens/s, on "
                        "stderr (default: on)")
    add_sampling_args(p, n_predict=-1)  # llama-cli's default: a reply runs to its end of turn
    add_llama_sampler_args(p)
    p.add_argument("--no-warmup", action="store_true",
                   help="accepted for llama.cpp's command lines: chat runs no warm-up decode")
    add_placement_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    first = prompt_arg(args)
    sampling = sampling_config(args)
    eng = open_engine(args)
    try:
        run_repl(ChatSession(eng, system=args.system, n_predict=args.n_predict, sampling=sampling,
                             show_stages=args.show_stages, hide_thinking=args.hide_thinking, color=args.color,
                             show_timings=args.show_timings),
                 first_message=first, single_turn=args.single_turn)
    finally:
        eng.close()
    return 0
