"""GRPO's sampling (llmtune.objectives.rollouts.generate_completions) against plain `model.generate` on the same
prompts.

The same model (a Llama-style config, random init), the same prompts (varied lengths, left-padded into one batch for
`generate`; GRPO pads them itself), the same number of new tokens for every row (no stop id can be drawn), the
same temperature and top-p: `generate` samples with its own warpers and the global RNG, GRPO with its per-row
counter-based Gumbel noise. Rounds alternate the two (the order reversed every other round); the figure is the
median of new tokens / s.

    python -m benchmarks.generation             # ~1 min on 2 cores
    python -m benchmarks.generation --rows 32 --new 128

Writes benchmarks/results/generation_cpu.json (generation_cuda.json on a GPU). Target: GRPO >= 0.9x generate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from benchmarks import run_header, write_results
from llmtune.objectives import rollouts as grpo
from llmtune.recipe import GRPOConfig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=64, help="new tokens a row")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 256), max_position_embeddings=1024,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(a.device).eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 65, (a.rows,), generator=g).tolist()
    prompts = [torch.randint(10, a.vocab, (n,), generator=g).tolist() for n in lengths]
    never = a.vocab + 1  # a stop id no sample can draw: every row makes all `new` tokens
    cfg = GRPOConfig(max_new_tokens=a.new, temperature=0.9, top_p=0.95)
    request = grpo.Sampling(prompts, list(range(a.rows)), cfg, [never], 0, a.rows, synced=False)
    ids, mask = grpo.left_padded(prompts, 0)
    plain = GenerationConfig(
        max_new_tokens=a.new, do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
        eos_token_id=[never], pad_token_id=0,
    )  # fmt: skip

    def grpo_sampling() -> int:
        return sum(len(c) for c in grpo.generate_completions(model, request))

    def generate() -> int:
        out = model.generate(ids.to(a.device), attention_mask=mask.to(a.device), generation_config=plain)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    runs = {"grpo": grpo_sampling, "generate": generate}
    rates: dict[str, list[float]] = {k: [] for k in runs}
    with torch.no_grad():
        for fn in runs.values():  # warm-up: first calls allocate and pick kernels
            fn()
        for r in range(a.rounds):
            for k in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                t0 = time.perf_counter()
                tokens = runs[k]()
                if a.device == "cuda":
                    torch.cuda.synchronize()
                rates[k].append(tokens / (time.perf_counter() - t0))
    median = {k: statistics.median(v) for k, v in rates.items()}
    results = {
        **run_header("generation", argv, a.device),
        "settings": vars(a) | {"prompt_lengths": lengths},
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_per_s": rates,
        "median_tokens_per_s": median,
        "grpo_vs_generate": median["grpo"] / median["generate"],
        "target": "grpo >= 0.9x generate",
        "seconds": time.perf_counter() - started,
    }
    print(f"{a.rows} rows, prompts {min(lengths)}-{max(lengths)} tokens, {a.new} new, {a.device}")
    for k, v in median.items():
        print(f"{k:10s} {v:9.0f} new tokens/s")
    print(f"grpo / generate: {results['grpo_vs_generate']:.2f}x")
    write_results(results, "generation", a.device)
    return results


if __name__ == "__main__":
    main()
