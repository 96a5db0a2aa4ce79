"""Numerical traps of low-precision training: bf16 weights losing small updates, fp16 overflow steps that
go uncounted. Tiny tensors: this CPU may emulate bf16 (~30x slower than fp32)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from llmtune.ops.optim import BF16AdamW, make_optimizer, stochastic_round_
from llmtune.parallel.engines import optimizer_step

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def drift_after(
    optimizer_class, dtype: torch.dtype, steps: int = 100, lr: float = 2e-5, device: str = "cpu", **kwargs
) -> float:
    """Mean change of weights ~N(0, 0.02) after `steps` updates with a constant positive gradient: AdamW's
    update is then lr per step, so fp32 drifts by exactly -lr x steps."""
    torch.manual_seed(0)
    w0 = torch.randn(64, 64, device=device) * 0.02
    p = torch.nn.Parameter(w0.to(dtype, copy=True))
    opt = optimizer_class([p], lr=lr, weight_decay=0.0, **kwargs)
    for _ in range(steps):
        p.grad = torch.full_like(p, 1e-3)
        opt.step()
    return float((p.detach().float() - w0.to(dtype).float()).mean())


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_bf16_weights_keep_small_updates_with_stochastic_rounding(device):
    expected = drift_after(torch.optim.AdamW, torch.float32, device=device)
    assert expected == pytest.approx(-100 * 2e-5, rel=1e-3)
    # The trap: bf16 weights with torch's (fused) AdamW round most of the update away.
    assert abs(drift_after(torch.optim.AdamW, torch.bfloat16, device=device, fused=True)) < 0.5 * abs(expected)
    # The fix keeps it (on average: stochastic rounding is unbiased).
    assert drift_after(BF16AdamW, torch.bfloat16, device=device) == pytest.approx(expected, rel=0.05)
    # fp32 parameters (LoRA adapters) take the exact AdamW update.
    assert drift_after(BF16AdamW, torch.float32, device=device) == pytest.approx(expected, rel=1e-5)


def test_bf16_second_moment_tracks_the_gradient():
    """exp_avg_sq moves by 0.1% a step (beta2 = 0.999), below bf16's resolution: rounded to nearest it
    stalls at about half of g^2 after 1000 steps (updates ~1.4x too large); stochastic rounding keeps it."""
    p = torch.nn.Parameter(torch.full((256,), 0.5, dtype=torch.bfloat16))
    opt = BF16AdamW([p], lr=1e-4, weight_decay=0.0)
    torch.manual_seed(0)
    for _ in range(1000):
        p.grad = torch.full_like(p, 0.01)
        opt.step()
    v_hat = opt.state[p]["exp_avg_sq"].float().mean() / (1 - 0.999**1000)
    assert float(v_hat) == pytest.approx(0.01**2, rel=0.03)


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    x = torch.full((20000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16 value, 1 + 2^-7
    out = torch.empty_like(x, dtype=torch.bfloat16)
    torch.manual_seed(0)
    for sign in (1, -1):
        stochastic_round_(out, sign * x)
        assert set(out.float().abs().unique().tolist()) == {1.0, 1.0 + 2**-7}
        assert float(out.float().mean()) == pytest.approx(sign * (1.0 + 2**-10), abs=2e-4)
    exact = torch.tensor([0.5, -3.0, 2**-20], dtype=torch.bfloat16)
    stochastic_round_(out[:3], exact.float())
    assert torch.equal(out[:3], exact)


def test_bf16_adamw_compiles_on_a_cpu_only_for_models_that_repay_it():
    """Compiling costs a CPU process 4-11 s and saves 5-14 ns per parameter a step: from 2^25 parameters it is
    repaid within ~65 steps; a smaller model keeps the eager step. On CUDA it always compiles. (Meta tensors: sizes
    without memory.)"""
    from llmtune.ops.optim import CPU_COMPILE_MIN_PARAMETERS, build_optimizer

    def param(numel: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.empty(numel, dtype=torch.bfloat16, device="meta"))

    halves = [param(CPU_COMPILE_MIN_PARAMETERS // 2) for _ in range(2)]
    assert build_optimizer("adamw_bf16", [{"params": halves[:1]}, {"params": halves[1:]}], "cpu", lr=1e-4)._fused
    assert build_optimizer("adamw_bf16", [param(CPU_COMPILE_MIN_PARAMETERS - 1)], "cpu", lr=1e-4)._fused is None
    assert build_optimizer("adamw_bf16", [param(1000)], "cuda", lr=1e-4)._fused


def test_bf16_adamw_rounding_noise_is_uniform_and_independent_for_each_element():
    """What keeps each rounding unbiased: under a step's fresh key, an element's three draws (weight, first and second
    moment) are uniform and independent of each other, and of a neighbour's. Over 4096 random keys, for elements 0, 1
    and 2^16 (a multiplied word's low half repeats every 2^16 elements: one multiply is not enough)."""
    from llmtune.ops.optim import rounding_noise

    keys = torch.randint(-(2**31), 2**31 - 1, (4096, 2), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    index = torch.tensor([0, 1, 2**16], dtype=torch.int32)
    draws = torch.stack([torch.stack(rounding_noise(index, k)) for k in keys]).reshape(len(keys), -1)  # 9 per key
    assert 0 <= draws.min() and draws.max() < 2**16
    # Each bit of the 9 draws as +-1: every bit balanced, and every two bits agreeing half the time (a bit shared by
    # two draws, or fixed by a neighbour's, agrees always). sigma = 1/64; the bound is 6.4 sigma over ~10k pairs.
    bits = ((draws[:, :, None] >> torch.arange(16)) & 1).reshape(len(keys), -1).double() * 2 - 1
    assert bits.mean(0).abs().max() < 0.1
    agreement = bits.T @ bits / len(keys) - torch.eye(bits.shape[1], dtype=torch.float64)
    assert agreement.abs().max() < 0.1, agreement.abs().max()


def test_make_optimizer_uses_bf16_adamw_for_bf16_weights_only(tiny_recipe, tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtune.model.adapters import apply_peft
    from llmtune.recipe import load_recipe

    recipe = load_recipe(tiny_recipe(training__precision="bf16-true"))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert isinstance(make_optimizer(model, recipe, torch.device("cpu")), BF16AdamW)
    # LoRA under bf16-true: the adapters are fp32, fused AdamW keeps their updates as before.
    lora = apply_peft(model, load_recipe(tiny_recipe(peft__method="lora")).peft, gradient_checkpointing=False)
    opt = make_optimizer(lora, recipe, torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    fp32 = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert type(make_optimizer(fp32, recipe, torch.device("cpu"))) is torch.optim.AdamW


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_fp16_overflow_is_detected_from_the_scaler(fused, device):
    """A real GradScaler and AdamW behind Accelerate's optimizer wrapper. Fused AdamW skips an inf step
    inside its kernel, so Accelerate's own `step_was_skipped` stays False; the scale drop tells."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=device == "cpu")  # the wrapper needs an initialised Accelerate state
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, device=device)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**16)
    opt = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused), scaler=scaler)

    def step(overflow: bool) -> bool:
        scaler.scale(model(torch.randn(4, 8, device=device)).square().mean()).backward()
        if overflow:
            model.weight.grad[0, 0] = float("inf")
        before = model.weight.detach().clone()
        skipped = bool(optimizer_step(opt, scaler)[1])  # [the scale it ran at, skipped], read once by the loop
        assert torch.equal(before, model.weight.detach()) == skipped  # skipped <=> weights unchanged
        opt.zero_grad()
        return skipped

    assert [step(o) for o in (False, True, False, True)] == [False, True, False, True]
    assert scaler.get_scale() == 2.0**14  # halved twice
    assert optimizer_step(torch.optim.SGD(model.parameters(), lr=0.1), None) is None  # no scaler: nothing to skip


def bf16_steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.to(p.dtype, copy=True)
        opt.step()


def test_bf16_adamw_replicas_stay_bit_identical_whatever_else_draws_from_the_global_rng():
    """DDP replicas: same weights, same (all-reduced) gradients, but each process draws the global RNG in its
    own way (dropout on differently padded batches). The rounding noise must not come from it, or the replicas'
    weights part after the first step and nothing brings them back."""
    data = torch.Generator().manual_seed(1)
    w0 = [torch.randn(64, 64, generator=data) * 0.02 for _ in range(2)]
    grads = [[torch.randn(64, 64, generator=data) * 1e-3 for _ in w0] for _ in range(4)]
    replicas = []
    for draw_before in (0, 7):
        params = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in w0]
        opt = BF16AdamW(params, lr=1e-4, weight_decay=0.0, seed=42)
        for step_grads in grads:
            torch.rand(draw_before)  # this process's other use of the global RNG, between steps
            bf16_steps(opt, params, [step_grads])
        replicas.append((params, opt))
    (a, opt_a), (b, opt_b) = replicas
    for pa, pb in zip(a, b, strict=True):
        assert torch.equal(pa, pb)
        assert all(torch.equal(opt_a.state[pa][k], opt_b.state[pb][k]) for k in ("exp_avg", "exp_avg_sq"))
    assert not torch.equal(a[0], w0[0].to(torch.bfloat16))  # it did train


def test_bf16_adamw_resumed_from_its_state_dict_takes_the_same_next_steps(tmp_path):
    """A checkpoint holds the optimizer's state_dict (Accelerate's save_state, or DCP under FSDP2): the run
    resumed from it, in a fresh process whose global RNG is wherever that process left it, must draw the rounding
    noise the uninterrupted run drew."""
    data = torch.Generator().manual_seed(2)
    w0 = torch.randn(128, 32, generator=data) * 0.02
    grads = [[torch.randn(128, 32, generator=data) * 1e-3] for _ in range(5)]
    p = torch.nn.Parameter(w0.to(torch.bfloat16))
    opt = BF16AdamW([p], lr=1e-4, weight_decay=0.0, seed=42)
    bf16_steps(opt, [p], grads[:3])
    torch.save({"weights": p.detach().clone(), "optimizer": opt.state_dict()}, tmp_path / "checkpoint.pt")
    bf16_steps(opt, [p], grads[3:])  # the uninterrupted run

    saved = torch.load(tmp_path / "checkpoint.pt")
    resumed = torch.nn.Parameter(saved["weights"])
    opt2 = BF16AdamW([resumed], lr=1e-4, weight_decay=0.0, seed=42)
    opt2.load_state_dict(saved["optimizer"])
    torch.rand(11)  # the new process's global RNG is not where the old one's was
    bf16_steps(opt2, [resumed], grads[3:])
    assert torch.equal(resumed, p)
    assert torch.equal(opt2.state[resumed]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


@pytest.mark.parametrize("precision", ["bf16", "bf16-true"])
def test_fsdp2_reduces_gradients_in_fp32_whatever_the_weights_dtype(precision, tmp_path):
    """As torchtitan: a bf16 sum over many processes keeps 8 mantissa bits, so FSDP2 reduce-scatters in fp32, bf16-true
    included (its policy had no reduce_dtype: gradients were reduced in bf16). One gloo process; the dtype FSDP2
    resolves from the policy at its first forward."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmtune.parallel.engines import shard_fsdp2

    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=64)  # fmt: skip
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if precision == "bf16-true" else None)
        shard_fsdp2(model, precision)
        ids = torch.randint(0, 64, (1, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        groups = [m._get_fsdp_state()._fsdp_param_group for m in (*model.model.layers, model)]
        assert {g._reduce_dtype for g in groups} == {torch.float32}
    finally:
        dist.destroy_process_group()


def _bf16_params(numel: int, count: int = 3, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(numel, generator=g) * 0.02).bfloat16()) for _ in range(count)]
    for p in params:
        p.grad = (torch.randn(numel, generator=g) * 1e-3).bfloat16()
    return params


def test_bf16_adamw_steps_each_parameter_in_one_kernel_that_bitcasts_in_registers(monkeypatch):
    """The eager update ran ~15 kernels and 3 random passes per 4M-element chunk (~10k launches a step on a 1B
    model); compiled, a parameter's update is one kernel whatever its chunk count (CHUNK shrunk: 1 and 16 chunks).
    And on a CPU that kernel keeps its values in vector registers: inductor's C++ backend bitcasts a vector element by
    element through memory (`tmpbuf_out[i] = c10::bit_cast<...>`), and the rounding bitcasts six times per element,
    which made the compiled step 3.2x torch's fused AdamW on a 4M-element tensor; llmtune.ops.inductor_bitcast makes
    each one `at::vec::cast`.
    Compiled afresh here (no cache), with its kernels named to the profiler."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    from benchmarks.optimizer import kernels_profiled, launches
    from llmtune.ops import optim

    monkeypatch.setattr(optim, "CHUNK", 256)
    torch._dynamo.reset()
    opt = BF16AdamW(_bf16_params(200) + _bf16_params(4000), lr=1e-4)
    with fresh_cache(), kernels_profiled():
        _, code = run_and_get_code(opt.step)  # states, and the compile
    assert not opt._fused.failed
    assert launches(opt) == 6  # the kernel of each parameter, nothing else on a CPU
    kernel = "\n".join(code)
    assert kernel.count("at::vec::cast<") >= 6
    assert "tmpbuf_out[i] = c10::bit_cast" not in kernel  # the scalar detour


def _bitcasts(x: torch.Tensor) -> torch.Tensor:
    """|2x| through its bits: a computed value viewed as int32 and back, which inductor's C++ backend scalarises."""
    return ((x * 2).view(torch.int32) & 0x7FFFFFFF).view(torch.float32)


def test_a_graph_compiled_with_register_bitcasts_has_a_cache_entry_of_its_own():
    """Inductor's caches (on disk, shared by every process and run) key a graph by its code and inductor's config, not
    by the patched code generator: a graph compiled without `vector_bitcasts` was served to a compile under it (a run
    of an older llmtune, a benchmark's baseline), the scalar detour with it, and the reverse. Under the patch a graph
    has a cache entry of its own (`torch.compiler.config.cache_key_tag`); the third compile, served the first's, shows
    the cache at work here (a cache that served nothing would pass the second for any key)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache, run_and_get_code

    from llmtune.ops.inductor_bitcast import vector_bitcasts

    x = torch.randn(256)
    with fresh_cache():
        for patched, served in ((False, False), (True, False), (False, True)):
            torch._dynamo.reset()  # a new process, as far as compiling goes: only the caches remain
            counters.clear()
            with vector_bitcasts() if patched else contextlib.nullcontext():
                out, code = run_and_get_code(torch.compile(_bitcasts, dynamic=False), x)
            hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
            assert bool(hits) == served, (patched, dict(counters["inductor"]))
            if not served:  # compiled here: in registers exactly where patched
                assert ("at::vec::cast<" in "\n".join(code)) == patched
            torch.testing.assert_close(out, (2 * x).abs())


def test_register_bitcasts_stand_aside_where_torch_bitcasts_vectors_itself(monkeypatch):
    """The upstream fix (a vector `to_dtype_bitcast` in inductor's C++ backend) makes the patch unnecessary: from the
    torch that has it, inductor's own is kept and its caches are shared as they are."""
    from torch._inductor.codegen import cpp

    from llmtune.ops.inductor_bitcast import vector_bitcasts

    upstream = staticmethod(lambda x, dtype, src_dtype: f"at::vec::cast<{cpp.DTYPE_TO_CPP[dtype]}>({x})")
    monkeypatch.setattr(cpp.CppVecOverrides, "to_dtype_bitcast", upstream)
    tag = torch.compiler.config.cache_key_tag
    with vector_bitcasts():
        assert cpp.CppVecOverrides.__dict__["to_dtype_bitcast"] is upstream
        assert torch.compiler.config.cache_key_tag == tag


def test_bf16_adamw_fused_and_eager_steps_round_alike(monkeypatch):
    """The noise is a function of each element's index, so the compiled kernel (whole parameters) and the eager
    fallback (chunks) draw the same; their fp32 math may differ in the last bit (the compiler contracts a * b + c
    into one rounding), which flips a rounding only where the value sits that close to a bf16 boundary."""
    from llmtune.ops import optim

    monkeypatch.setattr(optim, "CHUNK", 256)  # the eager step crosses chunk boundaries
    fused, eager = _bf16_params(1000, seed=3), _bf16_params(1000, seed=3)
    opts = BF16AdamW(fused, lr=1e-3, seed=5), BF16AdamW(eager, lr=1e-3, seed=5, compile=False)
    for _ in range(3):
        for opt in opts:
            opt.step()
    assert not opts[0]._fused.failed
    pairs = [(a, b) for a, b in zip(fused, eager, strict=True)]
    pairs += [(opts[0].state[a][k], opts[1].state[b][k]) for a, b in pairs for k in ("exp_avg", "exp_avg_sq")]
    differ = sum(int((a != b).sum()) for a, b in pairs)
    assert differ <= 0.002 * 9000, f"{differ} of 9000 elements rounded differently"
    assert not torch.equal(fused[0], _bf16_params(1000, seed=3)[0]), "it did train"
