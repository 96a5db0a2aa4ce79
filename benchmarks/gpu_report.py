"""The GPU check's report: gpu-<date>.md from the results benchmarks/gpu_check.py writes, one line per section
and a table for each measurement (the hot path, memory, CUDA kernel paths, planner, planner v2)."""

from __future__ import annotations

from typing import Any

from llmtune.units import format_bytes


def ckpt_word(checkpointing: bool | dict) -> str:
    return "offload" if isinstance(checkpointing, dict) else "on" if checkpointing else "off"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2%}"


def fmt_bytes(x: float | None) -> str:
    return "-" if x is None else format_bytes(x)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]


def markdown(results: dict) -> str:
    s = results["sections"]
    device = s.get("env", {}).get("device", "?")
    size = "tiny" if results["tiny"] else "full"
    lines = [f"# GPU check {results['date']}", "", f"`{results['command']}` on {device} ({size} size,"
             f" {results['seconds']:.0f} s)", ""]  # fmt: skip
    status = {True: " ok", False: " MISSED", None: ""}
    lines += table(
        ["section", "status", "seconds", "result"],
        [[n, sec["status"] + status[sec.get("ok")], f"{sec.get('seconds', 0):.0f}", headline(n, sec)]
         for n, sec in s.items()],
    )  # fmt: skip
    if s.get("memory", {}).get("rows"):
        lines += ["", "## Memory: estimate vs measured peak", ""]
        lines += table(
            ["model", "precision", "ckpt", "LoRA", "rows", "attn", "estimate", "allocated", "error", "reserved",
             "estimate vs reserved"],
            [[r["model"], r["precision"], ckpt_word(r["checkpointing"]), "r16" if r["lora"] else "-",
              "packed" if r["packed"] else "padded", r["attn"], fmt_bytes(r["estimate_bytes"]),
              fmt_bytes(r["measured_bytes"]), pct(r["error"]), fmt_bytes(r["reserved_bytes"]),
              pct(r["error_vs_reserved"])] for r in s["memory"]["rows"]],
        )  # fmt: skip
    if s.get("cuda_kernels", {}).get("rows"):
        lines += ["", "## CUDA kernel paths: estimate vs measured peak (Llama-3.1-8B, 4 layers)", ""]
        lines += table(
            ["case", "precision", "PEFT", "ckpt", "rows", "estimate", "allocated", "error", "estimate reserved",
             "reserved", "error vs reserved"],
            [[r["name"], r["precision"], r["peft"], ckpt_word(r["checkpointing"]), f"{r['micro']} x {r['seq_len']}",
              fmt_bytes(r["estimate_bytes"]), fmt_bytes(r["measured_bytes"]), pct(r["error"]),
              fmt_bytes(r["estimate_reserved_bytes"]), fmt_bytes(r["reserved_bytes"]), pct(r["error_vs_reserved"])]
             for r in s["cuda_kernels"]["rows"]],
        )  # fmt: skip
    if s.get("planner", {}).get("rows"):
        lines += ["", "## Planner (budget enforced as a hard limit)", ""]
        lines += table(
            ["budget", "planned (expected)", "peak", "OOM", "next size", "its peak",
             "find_executable_batch_size trials", "its pick"],
            [[r["budget"], f"{r['planned']} ({r['expected']})", fmt_bytes(r["peak_bytes"]), r["oom"], r["next"],
              fmt_bytes(r["next_peak_bytes"]) + (" fits" if r["next_fits"] else " over"), r["accelerate_trials"],
              r["accelerate_pick"]] for r in s["planner"]["rows"]],
        )  # fmt: skip
    if s.get("planner_v2", {}).get("table"):
        lines += ["", "## Planner v2: the pick against every candidate measured", ""]
        lines += s["planner_v2"]["table"].split("\n", 3)[3].strip().splitlines()  # benchmarks.planner's own table
    lines += hot_path(s)
    lines += ["", "Targets: " + ", ".join(f"{k} {v}" for k, v in results["targets"].items())]
    return "\n".join(lines) + "\n"


HOT_PATH = {"mfu": ("llmtune",), "vs_hf": ("llmtune", "hf"), "vs_trl": ("llmtune", "trl")}


def hot_path(s: dict) -> list[str]:
    """Issue 42's sections: each tool's run, the time model's forecast beside llmtune's, and each profiled step's top
    ops (GPU kernels' share of the step's device time; a CPU's ops' share of its time)."""
    done = [n for n in HOT_PATH if s.get(n, {}).get("status") == "done"]
    if not done:
        return []
    rows = []
    for name in done:
        sec = s[name]
        for tool in HOT_PATH[name]:
            r = sec[tool]
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") else ""
            rows.append([name, tool, r["micro_batch_size"], r["gradient_checkpointing"], r.get("compile", ""),
                         f"{r['tokens_per_s']:.0f}", mfu])  # fmt: skip
        f = sec["predicted"]
        rows.append([name, "time model", f["micro_batch_size"], f["checkpointing"], f["compiled"],
                     f"{f['tokens_per_s']:.0f}", f"{f['mfu']:.1%}" if f["mfu"] else ""])  # fmt: skip
        if "tokens_per_s_ratio" in sec:
            rows.append([name, f"llmtune/{HOT_PATH[name][1]}", "", "", "", f"{sec['tokens_per_s_ratio']:.2f}x", ""])
    lines = ["", "## Hot path: Llama-3.2-1B shape, full fine-tune, 8 rows a step", ""]
    lines += table(["section", "tool", "micro", "ckpt", "compiled", "tokens/s", "MFU"], rows)
    for name in done:
        for tool, prof in (s[name]["profile"] if name != "mfu" else {"llmtune": s[name]["profile"]}).items():
            if not prof:
                continue
            shares = prof.get("self_device_share") or prof["self_cpu_share"]
            where = "GPU" if "self_device_share" in prof else "CPU"
            lines += ["", f"Top ops, {name} / {tool} (share of one step's {where} time):", ""]
            lines += table(["op", "share"], [[op.replace("|", "/")[:90], f"{v:.1%}"] for op, v in shares.items()])
    return lines


def headline(name: str, sec: dict) -> str:
    if sec["status"] == "skipped":
        return sec["reason"]
    if name == "memory" and "summary" in sec:  # also when its time box cut the matrix short
        m = sec["summary"]
        return (f"{m['cases']} cases: median |error| {m['median_abs_error']:.2%}, worst {m['worst_abs_error']:.2%},"
                f" most under {pct(m['most_under'])}; {len(sec['failed'])} failed; skipped:"
                f" {', '.join(sec['skipped']) or 'none'}")  # fmt: skip
    if sec["status"] != "done":
        return (sec.get("error") or sec["status"]).strip().splitlines()[-1]
    if name == "env":
        peak = sec["mfu_peak"]
        return f"{sec['device']}, torch {sec['versions']['torch']}; MFU peak {peak['flops'] / 1e12:.1f} TFLOP/s" + (
            f" ({peak['source']}); matmul {sec['measured_matmul']['flops'] / 1e12:.1f}"
        )
    if name == "cuda_kernels":
        errors = ", ".join(f"{r['name']} {pct(r['error'])}" for r in sec["rows"])
        return f"estimate vs allocated: {errors or 'no cases'}; {len(sec['failed'])} failed; skipped: " + (
            ", ".join(sec["skipped"]) or "none"
        )
    if name == "planner":
        return f"{len(sec['rows'])} budgets, {sec['ooms']} OOMs, {len(sec['failed'])} failed"
    if name == "planner_v2":
        m = sec["summary"]
        room = m["pick_over_today_median_where_room"] or 0.0
        return (f"{m['cases']} budgets: pick/best min {m['pick_over_best_min']:.2f}, out-of-budget picks"
                f" {m['out_of_budget_picks']}, pick/every-layer median {room:.2f}, time model median |error|"
                f" {m['time_model_median_abs_error_raw']:.0%}")  # fmt: skip
    if name in HOT_PATH:
        f = sec["predicted"]
        forecast = f"forecast {f['tokens_per_s']:.0f}" + (f", MFU {f['mfu']:.1%}" if f["mfu"] else "")
        if name == "mfu":
            return f"MFU {sec['mfu']:.1%}, {sec['tokens_per_s']:.0f} tokens/s ({forecast})"
        other = HOT_PATH[name][1]
        return (f"tokens/s llmtune/{other}: {sec['tokens_per_s_ratio']:.2f}x ({sec['llmtune']['tokens_per_s']:.0f} vs"
                f" {sec[other]['tokens_per_s']:.0f}; llmtune {forecast})")  # fmt: skip
    if name == "fp16":
        return (f"{sec['skipped_steps']} skipped step(s) counted; the loss scale dropped at steps"
                f" {sec['scale_drops_at_steps']} (overflow injected at {sec['injected_at_step']})")  # fmt: skip
    if name == "bf16_true":
        moved = sec["moved_fraction_of_weights_nearest_rounding_cannot_move"]
        return f"{sec['optimizer']}: {moved:.0%} of the weights that rounding to nearest cannot move moved"
    if name == "resume":
        return f"loss after resume within {sec['max_rel_diff_after_resume']:.1e} of the straight run"
    if name == "dpo_reference":
        return "; ".join(f"{ref}: losses {[round(x, 4) for x in r['losses']]} on {r['device']}"
                         for ref, r in sec["runs"].items())  # fmt: skip
    if name == "generate_chat":
        return (f"on {sec['model_device']}: generate exit {sec['generate']['returncode']}, chat exit"
                f" {sec['chat']['returncode']}")  # fmt: skip
    if name == "qlora":
        return f"{sec['steps']} steps, losses {[round(x, 4) for x in sec['losses']]}"
    if name in ("fsdp2", "deepspeed_zero3", "fsdp2_dpo"):
        exits = [r["returncode"] for r in sec["runs"]]
        return f"launch {sec['runs'][0]['launch']}; exit {exits}; final/ loads: {sec['final_loads']}"
    if name == "gpu_tests":
        return sec["tail"].strip().splitlines()[-1] if sec["tail"].strip() else ""
    return ""
