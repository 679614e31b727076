"""`serve [-m MODEL]`: an OpenAI-compatible HTTP server with continuous batching (the embedded model
without -m). Flags follow llama-server's names (--host, --port, -np, --api-key, -a/--alias); the
model, placement and sampling flags are chat's, the sampling ones being the defaults a request's
own fields override."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from saem_gguf.cli.arg_types import bounded_int, non_negative_float
from saem_gguf.cli.common import (add_chat_args, add_llama_sampler_args, add_model_args, add_placement_args,
                                  add_sampling_args, sampling_config, unit_float)
from saem_gguf.cli.engine_args import open_engine
from saem_gguf.engine import MAX_PARALLEL
from saem_gguf.serving.reasoning import FORMATS

DEFAULT_PORT = 8080  # llama-server's
AUTO_PARALLEL = 4  # llama-server's -np auto
MAX_QUEUE = 100_000
WARM_UP_PROMPT = "Hello"  # what the warm-up run decodes after (its reply is thrown away)


def _api_keys(text: str) -> tuple[str, ...]:
    """llama-server's --api-key: one key, or several separated by commas."""
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    if not keys:
        raise argparse.ArgumentTypeError("an API key must not be empty")
    return keys


def _api_key_file(path: str) -> tuple[str, ...]:
    """llama-server's --api-key-file: one key per line, lines starting with # are comments. Unlike
    llama-server a file with no key is refused (there it would leave the server open), and a
    line's surrounding whitespace (a Windows line end) is not part of its key."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"failed to open file {path!r}: {getattr(e, 'strerror', None) or e}") from None
    keys = tuple(k.strip() for k in lines if k.strip() and not k.startswith("#"))
    if not keys:
        raise argparse.ArgumentTypeError(f"no API key in {path!r}")
    return keys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the embedded model)",
                       description="Serve a MoE GGUF over an OpenAI-compatible HTTP API with continuous "
                                   "batching and stage-aware expert placement: POST /v1/chat/completions "
                                   "and /v1/completions (streamed as server-sent events with \"stream\": "
                                   "true), llama-server's /completion, /infill, /tokenize, /detokenize, "
                                   "/apply-template and /props, GET /v1/models, /health, /metrics (Prometheus), "
                                   "/v1/saem/stats. SIGINT/SIGTERM stop it cleanly (exit 0).",
                       epilog="Threads: without -t and -tb, both a one-token decode (-t) and a ubatch of "
                              "several tokens (a prompt, a step of several sequences: -tb) get every usable "
                              "CPU but one, at every -np; -t alone sets both.")
    add_model_args(p)
    add_chat_args(p)
    g = p.add_argument_group("server (llama-server's names)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every "
                        "interface)")
    g.add_argument("--port", type=bounded_int(0, 65535), default=DEFAULT_PORT,
                   help=f"port to listen on ({DEFAULT_PORT}; 0: a free port, printed at start)")
    g.add_argument("-np", "--parallel", dest="n_parallel", type=bounded_int(1, MAX_PARALLEL), default=None,
                   metavar="N",
                   help=f"sequences decoded together (default {AUTO_PARALLEL}, llama-server's auto, with -kvu: each "
                        "may use the whole -c); given, each gets -c / N of the context unless -kvu")
    g.add_argument("-kvu", "--kv-unified", dest="kv_unified", action=argparse.BooleanOptionalAction, default=None,
                   help="one KV cache the sequences share, each using the whole -c while the others leave room "
                        "(llama-server's; default: on without -np, off with it, as llama-server); -no-kvu splits "
                        "it")
    g.add_argument("-no-kvu", dest="kv_unified", action="store_false", help=argparse.SUPPRESS)
    g.add_argument("--queue", dest="queue_max", type=bounded_int(1, MAX_QUEUE), default=64, metavar="N",
                   help="requests that may wait for a slot (64); one more is answered 503")
    g.add_argument("--api-key", dest="api_keys", type=_api_keys, default=None, metavar="KEY[,KEY...]",
                   help="require this key (Authorization: Bearer KEY, or X-Api-Key) on every route but "
                        "/health; a wrong or missing key is a 401")
    g.add_argument("--api-key-file", dest="api_key_files", type=_api_key_file, action="append", default=[],
                   metavar="FNAME", help="file of API keys, one per line, # for comments (with --api-key: all of "
                                         "them are accepted); repeatable")
    g.add_argument("--metrics", action="store_true",
                   help="accepted for llama-server's command lines: GET /metrics is always on here")
    g.add_argument("-cb", "--cont-batching", action="store_true",
                   help="accepted for llama-server's command lines: batching is always continuous here")
    g.add_argument("--threads-http", type=bounded_int(-1, 1 << 16), default=-1, metavar="N",
                   help="accepted for llama-server's command lines: HTTP requests are served by one event loop "
                        "here (uvicorn's); the value is checked, not used")
    g.add_argument("--no-webui", action="store_true",
                   help="accepted for llama-server's command lines: there is no web UI here")
    g.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="the model's name in /v1/models and answers (default: the GGUF's file name)")
    g.add_argument("--no-context-shift", action="store_true",
                   help="llama-server's default, taken so that its command lines run: a sequence whose "
                        "context is full ends (finish_reason length); context shift is not supported")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up run (llama-server's flag): by default every slot decodes a few "
                        "tokens before the server says it is ready, so that the first requests do not pay "
                        "the one-time costs (the placement kernels' compilation, about 11 s on a fresh checkout here)")
    g.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0, metavar="SECONDS",
                   help="after SIGINT/SIGTERM, requests in flight may finish for this long (10), then they "
                        "are cancelled and answered with a 503; a second Ctrl-C stops at once")
    g.add_argument("--reasoning-format", choices=FORMATS, default="auto",
                   help="a chat answer's thinking: apart as message.reasoning_content (deepseek; auto: where the "
                        "chat template is a reasoning one, as llama-server decides), or left in content (none)")
    g.add_argument("--parse-special", action="store_true",
                   help="raw prompts (/v1/completions, /completion) turn special-token text into those tokens, as "
                        "llama-server and llama-cpp-python do (default: literal text; chats' markup is always "
                        "parsed and message text never)")
    g.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="llama-server's prompt cache for requests that do not say (cache_prompt): a request starts "
                        "from the cells a slot kept of an earlier one, as far as their prompts agree (default: on)")
    g.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                   help="llama-server's GET /slots: each slot and whether it is busy (default: on)")
    g.add_argument("--prefill-assistant", action=argparse.BooleanOptionalAction, default=True,
                   help="a chat whose last message is the assistant's continues it, as llama-server's assistant "
                        "prefill (default: on; --no-prefill-assistant: a new answer after it)")
    g.add_argument("-cram", "--cache-ram", type=bounded_int(-1, 1 << 30), default=8192, metavar="N",
                   help="host memory in MiB for llama-server's prompt cache: the KV cells of prompts a slot is "
                        "about to lose, loaded again for a later request that shares their beginning (8192, "
                        "llama-server's; -1: no limit, 0: none)")
    g.add_argument("-sps", "--slot-prompt-similarity", dest="slot_similarity", type=unit_float, default=0.1,
                   metavar="SIMILARITY",
                   help="share of a request's prompt a free slot's cells must hold for the request to go there "
                        "rather than to the least recently used slot (0.1, llama-server's; 0: always that one)")
    g.add_argument("--spm-infill", action="store_true",
                   help="/infill: the suffix before the prefix (suffix/prefix/middle), as llama-server's flag, "
                        "for models trained so (default: prefix/suffix/middle)")
    add_sampling_args(p, n_predict=-1)
    add_llama_sampler_args(p, request_defaults=True)
    add_placement_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from saem_gguf.serving.app import ServeConfig, ServerState, create_app
    from saem_gguf.serving.batch import Scheduler
    from saem_gguf.serving.metrics import ServerMetrics
    from saem_gguf.serving.server import ListenConfig, LoadingAnswers, bind, serve, url_of
    from saem_gguf.serving.threads import serve_threads, usable_cpus

    # -s is the seed of a request without one (None: a random one per request)
    sampling = replace(sampling_config(args), seed=args.seed)
    listen = ListenConfig(host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
                          verbose=args.verbose)
    sock = bind(listen.host, listen.port)  # before the model loads: a taken port fails at once
    loading = LoadingAnswers(sock).start()  # 503 "Loading model" until then, as llama-server
    try:
        threads = serve_threads(usable_cpus(), args.threads, args.threads_batch)
        # llama-server's -np auto: 4 slots sharing one KV cache; an explicit -np splits it
        n_parallel = AUTO_PARALLEL if args.n_parallel is None else args.n_parallel
        unified = args.n_parallel is None if args.kv_unified is None else args.kv_unified
        eng = open_engine(args, n_parallel=n_parallel, kv_unified=unified, n_threads=threads.n_threads,
                          n_threads_batch=threads.n_threads_batch)
        try:
            scheduler = Scheduler(eng, n_parallel=n_parallel, queue_max=args.queue_max,
                                  cache_ram_mib=args.cache_ram, slot_similarity=args.slot_similarity)
            if sampling.grammar is not None:  # every request without its own grammar gets it
                scheduler.check_grammar(sampling.grammar, "the grammar")
            cfg = ServeConfig(model_id=args.alias or eng.path.name, sampling=sampling,
                              max_tokens=args.n_predict, n_ctx_per_sequence=scheduler.n_ctx_seq,
                              api_keys=(*(args.api_keys or ()), *(k for f in args.api_key_files for k in f)),
                              system=args.system,
                              reasoning_format=args.reasoning_format, chat_template=eng.chat_template_source(),
                              parse_special=args.parse_special, n_batch=args.n_batch,
                              spm_infill=args.spm_infill, cache_prompt=args.cache_prompt,
                              prefill_assistant=args.prefill_assistant, endpoint_slots=args.slots)
            state = ServerState(scheduler=scheduler, piece=eng.piece, cfg=cfg,
                                metrics=ServerMetrics(scheduler.stats))
            scheduler.start(warm_up=scheduler.tokenize_prompt(WARM_UP_PROMPT) if args.warmup else None)
            app = create_app(state)
            loading.stop()  # first: a client told the URL below gets the model's answers
            if not args.quiet:
                print(f"[saem] serving {cfg.model_id} at {url_of(sock)} (-np {n_parallel}{' -kvu' if unified else ''}, "
                      f"-t {threads.n_threads} -tb {threads.n_threads_batch}, policy {eng.stats()['policy']}); "
                      "Ctrl-C stops", file=sys.stderr, flush=True)
            serve(app, state, sock, listen)
        finally:
            eng.close()
    finally:
        loading.stop()
        sock.close()
    return 0
