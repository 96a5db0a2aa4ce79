"""`python -m benchmarks.gpu_check` at toy size on a CPU, so the one-shot GPU check cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_SECTIONS = (
    "env", "mfu", "vs_hf", "vs_trl", "bf16_true", "resume", "dpo_reference", "generate_chat", "grpo", "planner",
    "planner_v2", "memory",
)  # fmt: skip
CUDA_SECTIONS = (
    "optimizer", "generation", "fp16", "gpu_tests", "fsdp2", "deepspeed_zero3", "fsdp2_dpo", "qlora", "cuda_kernels",
)  # fmt: skip


@pytest.mark.slow
def test_gpu_check_tiny_runs_every_section_and_writes_its_results(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--tiny", "--out", str(tmp_path)]  # as `make gpu-check`
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = tmp_path.glob("gpu-tiny-*.json")
    sections = json.loads(path.read_text())["sections"]
    assert set(sections) == set(CPU_SECTIONS + CUDA_SECTIONS)
    for name in CUDA_SECTIONS:  # --tiny runs on the CPU even where a GPU is
        assert sections[name]["status"] == "skipped" and sections[name]["reason"].startswith("no CUDA"), name
    for name in CPU_SECTIONS:
        assert sections[name]["status"] == "done", (name, sections[name].get("error"))
    assert sections["env"]["loss_head"].endswith("(cpu has no fp32-output GEMM)")  # on a GPU: which path, and why
    assert sections["bf16_true"]["ok"] and sections["bf16_true"]["optimizer"] == "BF16AdamW"
    assert sections["resume"]["ok"]
    memory = sections["memory"]
    # On a CPU the estimator is exact but for packed rows' block-diagonal masks, which it leaves out: 1.5% of
    # the peak at toy size with checkpointing (measured); b x s^2 bytes, small beside real activations.
    assert memory["rows"] and memory["summary"]["worst_abs_error"] < 0.05
    assert {r["precision"] for r in memory["rows"]} == {"bf16", "bf16-true"}
    assert "fp16 (needs CUDA)" in memory["skipped"]
    planner = sections["planner"]
    assert planner["ooms"] == 0 and planner["ok"], planner["rows"]
    assert all(r["accelerate_trials"][0] == 2 for r in planner["rows"])  # it starts at the global batch
    v2 = sections["planner_v2"]
    assert v2["summary"]["cases"] == 3 and v2["summary"]["out_of_budget_picks"] == 0, v2["summary"]
    # Issue 42's hot path: each tool ran and was profiled, the time model forecast llmtune's runs.
    assert sections["mfu"]["llmtune"]["packed"] and sections["mfu"]["profile"]["self_cpu_share"]
    assert sections["vs_hf"]["hf"]["optimizer_class"] and sections["vs_hf"]["profile"].keys() == {"llmtune", "hf"}
    assert sections["vs_trl"]["trl"]["padding_free"] and sections["vs_trl"]["profile"]["trl"]["self_cpu_share"]
    for name in ("mfu", "vs_hf", "vs_trl"):
        assert sections[name]["predicted"]["tokens_per_s"] > 0 and not sections[name]["predicted"]["compiled"], name
    report = path.with_suffix(".md").read_text()
    assert "## Memory" in report and "## Planner" in report and "## Hot path" in report
    assert "| vs_trl | llmtune/trl |" in report and "Top ops, vs_hf / hf" in report
    assert "## Planner v2" in report and "| llama-h64-L2 | tight" in report
    assert "| fp16 | skipped |" in report
    dpo = sections["dpo_reference"]
    assert dpo["ok"] and set(dpo["runs"]) == {"precomputed", "copy"}, dpo
    assert all(r["steps"] == 1 and r["device"] == "cpu" for r in dpo["runs"].values())
    chat = sections["generate_chat"]
    assert chat["ok"] and chat["model_device"] == "cpu" and len(chat["chat"]["transcript"].splitlines()) == 3, chat
    assert "| dpo_reference | done ok |" in report and "| generate_chat | done ok |" in report
    grpo = sections["grpo"]
    assert grpo["ok"] and grpo["generation_rows"] and grpo["predicted_generation_bytes"], grpo
