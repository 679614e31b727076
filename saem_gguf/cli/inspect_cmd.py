"""`inspect MODEL`: the MoE shape of a GGUF, its expert bytes, and what a VRAM or RAM budget buys."""

from __future__ import annotations

import argparse
import json

from saem_gguf.budget import ECR_HELP, format_size, parse_size, plan_from_budget, plan_from_ecr
from saem_gguf.cli.arg_types import bounded_int
from saem_gguf.cli.common import ecr_arg, ram_budget_arg
from saem_gguf.gguf_info import ModelInfo, read_model_info
from saem_gguf.model_check import MAX_CONTEXT
from saem_gguf.resources import context_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show a GGUF's experts, their bytes, and cache sizing",
                       description="Read a GGUF (no llama.cpp load) and report its MoE layout: "
                                   "layers, experts, per-expert bytes by quant type; with a VRAM "
                                   "budget, the expert slots per layer it buys (ECR), or the reverse.")
    p.add_argument("model", metavar="MODEL", help="path to a .gguf file")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--vram-budget", metavar="SIZE", help="device memory to plan for, e.g. 8G, 12GiB")
    g.add_argument("--ecr", metavar="R", type=ecr_arg, help=ECR_HELP + ": the VRAM it needs")
    p.add_argument("-c", "--ctx-size", type=bounded_int(0, MAX_CONTEXT), default=None,
                   help="context for the KV cache (default: 4096, or the model's own context length where it is "
                        "shorter, as the other commands; 0: the model's own)")
    p.add_argument("--overhead", metavar="SIZE", default=None,
                   help="device compute-buffer reserve (default: estimated from the model)")
    p.add_argument("--ram-budget", metavar="SIZE|auto", type=ram_budget_arg, default=None,
                   help="RAM tier: the experts per layer SIZE keeps resident (auto: this machine's "
                        "available memory), the RAM the model then needs and the expert bytes left on disk")
    p.add_argument("--layers", action="store_true", help="list every MoE layer's expert tensors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    info = read_model_info(args.model)
    args.ctx_size = context_size(info, args.ctx_size)  # -c 0 or none: as the engine reads it
    overhead = parse_size(args.overhead) if args.overhead is not None else None
    plan = None
    if args.vram_budget is not None:
        plan = plan_from_budget(info, parse_size(args.vram_budget), args.ctx_size, overhead)
    elif args.ecr is not None:
        plan = plan_from_ecr(info, args.ecr, args.ctx_size, overhead)
    ram = ram_rows(info, args.ram_budget, args.ctx_size) if args.ram_budget is not None else None
    if args.json:
        out = info.to_dict()
        out["bytes_per_expert_all_layers"] = info.bytes_per_expert_all_layers
        if plan is not None:
            out["cache_plan"] = plan.to_dict()
        if ram is not None:
            out["ram_plan"] = ram[1]
        print(json.dumps(out, indent=2))
        return 0
    print(render(info, args.layers))
    if plan is not None:
        print()
        rows = [("context (-c)", str(plan.n_ctx)),
                ("non-expert weights", format_size(plan.non_expert_bytes)),
                ("KV cache (f16)", format_size(plan.kv_bytes)),
                ("compute buffers", format_size(plan.compute_bytes)),
                ("expert cache", f"{format_size(plan.cache_bytes)} = {plan.slots_per_layer} slots x "
                                 f"{len(info.moe_layers)} layers"),
                ("ECR", f"{plan.ecr:.2%} ({plan.slots_per_layer}/{info.n_expert} per layer)"),
                ("VRAM needed", format_size(plan.vram_bytes))]
        if plan.note:
            rows.append(("note", plan.note))
        print(_table(rows, "expert cache plan"))
    if ram is not None:
        print()
        print(_table(ram[0], "RAM tier plan (memory-mapped model)"))
    return 0


def ram_rows(info: ModelInfo, budget, n_ctx: int) -> tuple[list[tuple[str, str]], dict]:
    """What ``--ram-budget`` keeps resident: rows for the table and the same as JSON."""
    from saem_gguf.gguf_info import compute_buffer_bytes, kv_cache_bytes
    from saem_gguf.ram_tier import plan_ram_budget

    rb = plan_ram_budget(info, budget, n_ctx)
    kv, comp = kv_cache_bytes(info, n_ctx), compute_buffer_bytes(info)
    need = info.non_expert_bytes + kv + comp + rb.resident_bytes
    on_disk = info.expert_bytes - rb.resident_bytes
    rows = [("non-expert weights", f"{format_size(info.non_expert_bytes)} (locked in RAM)"),
            ("KV cache (f16)", format_size(kv)), ("compute buffers", format_size(comp)),
            ("resident experts", f"{format_size(rb.resident_bytes)} = {rb.slots}/{info.n_expert} per layer "
                                 f"({rb.fraction:.1%})"),
            ("experts left on disk", f"{format_size(on_disk)} (read when routed to)"),
            ("RAM needed", format_size(need))]
    if rb.note:
        rows.append(("note", rb.note))
    data = {"budget_bytes": rb.budget_bytes, "slots_per_layer": rb.slots, "fraction": rb.fraction,
            "resident_expert_bytes": rb.resident_bytes, "expert_bytes_on_disk": on_disk,
            "non_expert_bytes": info.non_expert_bytes, "kv_bytes": kv, "compute_bytes": comp,
            "ram_needed_bytes": need, "note": rb.note}
    return rows, data


def _table(rows: list[tuple[str, str]], title: str) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join([title, "-" * len(title)] + [f"{k:<{w}}  {v}" for k, v in rows])


def render(info: ModelInfo, layers: bool = False) -> str:
    rows = [("file", f"{info.path} ({format_size(info.file_bytes)})"),
            ("architecture", info.architecture + (f"  ({info.name})" if info.name else "")),
            ("layers", str(info.n_layer)),
            ("embedding", f"{info.n_embd}  (heads {info.n_head}, kv heads {info.n_head_kv})"),
            ("vocabulary", str(info.n_vocab))]
    if not info.is_moe:
        rows.append(("experts", "none: dense model (expert management does not apply)"))
        rows.append(("weights", format_size(info.non_expert_bytes)))
        return _table(rows, "model")
    rows += [
        ("experts", f"{info.n_expert} routed, top-{info.n_expert_used}"
                    + (f", {info.n_expert_shared} shared" if info.n_expert_shared else "")),
        ("expert FFN", str(info.n_ff_exp)),
        ("MoE layers", f"{len(info.moe_layers)} of {info.n_layer}"),
        ("expert types", ", ".join(info.expert_types)),
        ("bytes / expert", f"{format_size(info.moe_layers[0].bytes_per_expert)} per layer, "
                           f"{format_size(info.bytes_per_expert_all_layers)} across all MoE layers"),
        ("expert weights", format_size(info.expert_bytes)),
        ("non-expert", format_size(info.non_expert_bytes)
                       + (f"  (matrices {', '.join(info.matrix_types)})" if info.matrix_types else "")),
    ]
    out = _table(rows, "model")
    if layers:
        lines = ["", "layer  tensor                         type    shape                bytes"]
        for l in info.moe_layers:
            for t in l.tensors:
                lines.append(f"{l.index:>5}  {t.name:<30} {t.type:<7} {str(t.shape):<20} "
                             f"{format_size(t.nbytes)}")
        out += "\n" + "\n".join(lines)
    return out
