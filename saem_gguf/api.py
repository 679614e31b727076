"""``from saem_gguf import Llama``: llama-cpp-python's ``Llama`` with stage-aware expert management.

The class is the engine's own model object (``engine.SaemLlama`` with an ``Engine`` attached), so
the Python API and the CLI run one mechanism: every ubatch's routing feeds the stage detector and
the placement policy, exactly as under ``generate``/``chat``. Everything llama-cpp-python's ``Llama``
offers works unchanged (``create_completion``, ``create_chat_completion``, streaming, ``__call__``,
``tokenize``, ...), with four differences, the first three toward llama.cpp:

* ``seed=0`` is a fixed seed (llama-cpp-python 0.3.36 turns 0 into its random default);
* ``create_chat_completion`` tokenizes message contents as plain text: a message containing
  ``<|im_end|>`` or ``<|im_start|>system`` cannot close its turn or open another one;
* extra arguments: ``expert_policy``, ``ecr`` / ``vram_budget``, ``profile``, ``hw``,
  ``ram_budget`` / ``ram_policy`` (the RAM tier, docs/RAM_TIER.md), the ``expert_stats()`` method,
  and ``create_chat_completion(..., chat_template_kwargs={...})``: more variables for the chat
  template, llama-server's request field (``{"enable_thinking": False}`` for Qwen3), which
  llama-cpp-python's method has no way to pass;
* after ``close()`` every method raises a SaemError (``expert_stats()`` still reads the books):
  llama-cpp-python's ``close`` frees the model but keeps its pointers, and a later call killed
  the process (SIGSEGV).

Importing this module loads the patched llama.cpp (``saem_gguf.llama_lib``).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from saem_gguf.budget import parse_ecr, parse_vram_budget
from saem_gguf.engine import Engine, EngineConfig, _make_llama_class, check_template_kwargs
from saem_gguf.llama_lib import load_llama_cpp

llama_cpp = load_llama_cpp()
_SaemLlama = _make_llama_class(llama_cpp)


class Llama(_SaemLlama):
    def __init__(self, model_path: str, *, expert_policy: str = "saem", ecr: float | str | None = None,
                 vram_budget: int | str | None = None, profile: str | Path | None = None,
                 hw: str | None = None, ram_budget: int | str | None = None, ram_policy: str | None = None,
                 n_ctx: int = 512, n_threads: int | None = None,
                 n_gpu_layers: int = 0, seed: int = llama_cpp.LLAMA_DEFAULT_SEED, verbose: bool = True,
                 **kwargs: Any) -> None:
        """llama-cpp-python's arguments (same names and defaults), plus:

        expert_policy: the placement policy (``saem``, ``lru``, ``cpu-moe``, ... as ``--policy``).
        ecr: expert cache ratio, 0.25 or "25%" (default 25%); or vram_budget: bytes or "8G".
        profile: a calibration profile from ``python -m saem_gguf calibrate``.
        hw: the cost-model hardware preset the policy prices copies with.
        ram_budget: expert bytes kept in RAM of a memory-mapped model, bytes, "8G" or "auto" (the
            RAM tier; default off); ram_policy: its policy (default: expert_policy's).
        """
        from saem_gguf.ram_tier import parse_ram_budget

        # llama-cpp-python's kv_overrides: checked before the load as --override-kv (an
        # expert_used_count of 0 aborts llama.cpp) and the placement sized by them
        kv_overrides = tuple((kwargs.pop("kv_overrides", None) or {}).items())
        cfg = EngineConfig(
            model=Path(model_path), n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
            policy=expert_policy, ecr=parse_ecr(ecr) if isinstance(ecr, str) else ecr,
            vram_budget=parse_vram_budget(vram_budget) if isinstance(vram_budget, str) else vram_budget,
            profile=Path(profile) if profile is not None else None, verbose=verbose, progress=False,
            ram_budget=parse_ram_budget(ram_budget) if isinstance(ram_budget, str) else ram_budget,
            ram_policy=ram_policy, kv_overrides=kv_overrides,
            **({"hw": hw} if hw is not None else {}))

        def construct(**engine_kwargs: Any) -> Llama:
            # the caller's llama-cpp-python arguments win over the engine's choices
            _SaemLlama.__init__(self, **{**engine_kwargs, "seed": seed, **kwargs})
            return self

        self._saem_engine = Engine(cfg, construct=construct)
        # llama-cpp-python keeps `seed or LLAMA_DEFAULT_SEED`: 0 would be random, it is a seed
        self._seed = seed

    def expert_stats(self) -> dict:
        """Expert placement so far: policy, cache slots per layer, hit rate, bytes moved, stage
        boundaries (the numbers ``chat``'s /stats shows)."""
        return self._saem_engine.stats()

    def close(self) -> None:
        # a constructor that failed before llama-cpp-python's own init ran has nothing to close
        if "_stack" in self.__dict__:
            super().close()
        self._saem_closed = True

    def create_chat_completion(self, messages, *args, chat_template_kwargs: dict[str, Any] | None = None,
                               **kwargs):
        """llama-cpp-python's, plus ``chat_template_kwargs``: variables its chat handler hands to the
        template (a Jinja one reads them; a name the handler sets itself is a SaemError)."""
        if not chat_template_kwargs:
            return super().create_chat_completion(messages, *args, **kwargs)
        check_template_kwargs(chat_template_kwargs)
        # the handler's keyword arguments, as llama-cpp-python's create_chat_completion passes them
        call = inspect.signature(llama_cpp.Llama.create_chat_completion).bind(self, messages, *args, **kwargs)
        call.apply_defaults()
        handler_kw = {k: v for k, v in call.arguments.items() if k not in ("self", "messages")}
        return self.saem_chat_completion(messages, dict(chat_template_kwargs), **handler_kw)

    def create_completion(self, prompt, *args, **kwargs):
        if not self._saem_capture:
            self._saem_engine.reset_sequence()  # each completion is a new sequence for the detector
        return super().create_completion(prompt, *args, **kwargs)
