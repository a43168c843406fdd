"""Eager decoding's plan (efftx.models.cpu_plan): a dense LM's cached CPU pass as one flat run of kernel calls. Its
logits and caches are bit for bit the module path's (the reference), over batch sizes, tokens per pass, ragged rows
and model shapes, in generation and in continuous batching; it runs only where the module path's norms and
attention would take the kernels (its products: the linear kernel's, or past 16 rows x tokens torch's); hooks,
replaced weights and modules, and weights moved to another type send passes back to the module path or make the
plan again."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from efftx import recipes
from efftx.generation.decode import generate
from efftx.kernels import decode_attention_cpu, linear_cpu, rms_norm_cpu
from efftx.models import build, cpu_plan
from efftx.models.layers import MLP


def model_of(recipe: str = "spec_target_debug", seed: int = 0, **overrides):
    cfg = recipes.get(recipe)
    if overrides:
        cfg = cfg.override(overrides)
    torch.manual_seed(seed)
    return build(cfg).eval()


@pytest.fixture
def runs(monkeypatch):
    """The passes the plan ran (a spy around CpuPlan.run)."""
    seen = []
    real = cpu_plan.CpuPlan.run

    def spy(self, tokens, cache, kernels):
        seen.append(tuple(tokens.shape))
        return real(self, tokens, cache, kernels)

    monkeypatch.setattr(cpu_plan.CpuPlan, "run", spy)
    return seen


def twin_passes(model, prompts: list[list[int]], feeds: list[torch.Tensor], capacity: int = 64):
    """The same cached passes through the plan and through the module path, on two caches: -> both runs' logits
    of every pass and their caches (rows of different prompt lengths: a ragged cache)."""
    out = {}
    for mode in ("plan", "module"):
        cache = model.new_cache(len(prompts), capacity)
        with torch.no_grad(), cpu_plan.disabled():
            for i, prompt in enumerate(prompts):  # each row its own length
                row = model.new_cache(1, capacity)
                model(torch.tensor([prompt]), cache=row)
                for full, one in zip(cache.layers, row.layers):
                    full.k[i], full.v[i], full.lengths[i] = one.k[0], one.v[0], one.lengths[0]
        logits = []
        with torch.no_grad():
            for feed in feeds:
                if mode == "module":
                    with cpu_plan.disabled():
                        logits.append(model(feed, cache=cache))
                else:
                    logits.append(model(feed, cache=cache))
        out[mode] = logits, cache
    return out["plan"], out["module"]


@pytest.mark.parametrize("recipe,overrides", [
    ("spec_target_debug", {}), ("spec_draft_debug", {}), ("lm_debug", {}), ("nsa_full_debug", {}),
    ("spec_target_debug", {"model.kv_heads": 1}), ("spec_target_debug", {"model.tie_embeddings": False}),
    ("lm_debug", {"model.emb_dim": 16})],
    ids=["target", "draft", "lm", "nsa_full", "gqa", "untied", "factorised_embedding"])
def test_the_plans_logits_and_caches_are_the_module_paths_bit_for_bit(recipe, overrides, runs):
    model = model_of(recipe, **overrides)
    assert cpu_plan.unsupported(model) is None
    g = torch.Generator().manual_seed(1)
    vocab = model.vocab_size
    # rows x tokens up to 16 (the linear kernel's products) and past it (torch's, as the module path's)
    for batch, tokens in ((1, 1), (1, 6), (3, 1), (3, 5), (4, 4), (8, 2), (16, 1), (1, 16), (4, 6), (17, 1), (16, 6)):
        prompts = [torch.randint(0, vocab, (3 + 2 * i,), generator=g).tolist() for i in range(batch)]
        feeds = [torch.randint(0, vocab, (batch, tokens), generator=g) for _ in range(3)]
        before = len(runs)
        (plan, plan_cache), (ref, ref_cache) = twin_passes(model, prompts, feeds)
        assert len(runs) - before == len(feeds), "every pass through the plan"
        for a, b in zip(plan, ref):
            assert torch.equal(a, b), (batch, tokens)
        for p, r in zip(plan_cache.layers, ref_cache.layers):
            assert p.lengths == r.lengths and torch.equal(p.k, r.k) and torch.equal(p.v, r.v)


@pytest.mark.parametrize("batch,tokens", [(1, 17), (3, 40), (1, decode_attention_cpu.MAX_QUERIES),
                                          (1, decode_attention_cpu.MAX_QUERIES + 1), (3, 150)])
def test_prefills_of_longer_prompts_take_the_plan_bit_for_bit(batch, tokens, runs):
    """Passes of more tokens a row than a decoding step (prompts' prefills) run through the plan, the attention
    kernel's up to MAX_QUERIES tokens a row and torch's attention (the rotary, then SDPA) past them, as the module
    path does: the same logits and caches, over ragged rows."""
    model = model_of("spec_target_debug", **{"model.max_seq_len": 512})
    g = torch.Generator().manual_seed(tokens)
    prompts = [torch.randint(0, model.vocab_size, (3 + 5 * i,), generator=g).tolist() for i in range(batch)]
    feeds = [torch.randint(0, model.vocab_size, (batch, tokens), generator=g) for _ in range(2)]
    (plan, plan_cache), (ref, ref_cache) = twin_passes(model, prompts, feeds, capacity=3 + 5 * batch + 2 * tokens)
    assert len(runs) == len(feeds), "every pass through the plan"
    for a, b in zip(plan, ref):
        assert torch.equal(a, b)
    for p, r in zip(plan_cache.layers, ref_cache.layers):
        assert p.lengths == r.lengths and torch.equal(p.k, r.k) and torch.equal(p.v, r.v)


def test_greedy_and_sampled_generation_through_the_plan_equal_the_module_paths(runs):
    model = model_of("spec_target_debug")
    prompts = torch.randint(0, model.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), cpu_plan.disabled():
        greedy = generate(model, prompts, 12, temperature=0.0)
        torch.manual_seed(5)
        sampled = generate(model, prompts, 12, temperature=0.9)
    assert not runs
    with torch.no_grad():
        assert torch.equal(generate(model, prompts, 12, temperature=0.0), greedy)
        torch.manual_seed(5)
        assert torch.equal(generate(model, prompts, 12, temperature=0.9), sampled)
    assert len(runs) >= 2 * 11


def test_which_passes_take_the_plan(runs):
    model = model_of("spec_target_debug")
    vocab = model.vocab_size

    def planned(tokens: torch.Tensor, cache=None, grad: bool = False) -> bool:
        cache = cache if cache is not None else model.new_cache(tokens.shape[0], 64)
        before = len(runs)
        with torch.set_grad_enabled(grad):
            model(tokens, cache=cache)
        return len(runs) > before

    one = torch.randint(0, vocab, (2, 1))
    assert planned(one)
    assert not planned(one, grad=True)  # autograd records the pass: the module path (F.linear and the rest)
    assert planned(torch.randint(0, vocab, (16, 1))) and planned(torch.randint(0, vocab, (1, 16)))
    assert planned(torch.randint(0, vocab, (17, 1))) and planned(torch.randint(0, vocab, (4, 5)))  # torch's products
    assert planned(torch.randint(0, vocab, (1, 17))) and planned(torch.randint(0, vocab, (2, 40)))  # prompts' prefills
    before = len(runs)
    with torch.no_grad():
        model(one)  # no cache: the module path
    assert len(runs) == before
    for switched_off in (cpu_plan.disabled, linear_cpu.disabled, rms_norm_cpu.disabled, decode_attention_cpu.disabled):
        with switched_off():
            assert not planned(one)
    model.train()  # a training model (its dropout, if any, drops): the module path
    assert not planned(one)
    model.eval()
    assert planned(one)
    cache = model.new_cache(2, 64)
    cache.layers[0].k = cache.layers[0].k.transpose(0, 1).contiguous().transpose(0, 1)  # a cache not contiguous
    assert not planned(one, cache)
    for recipe, why in (("nsa_debug", "not full attention"), ("performer_debug", "reversible"),
                        ("dalle_shapes_debug", "learned positions")):
        assert why in cpu_plan.unsupported(build(recipes.get(recipe)))
    layernorm = model_of("spec_target_debug", **{"model.norm": "layernorm"})
    assert "RMSNorm" in cpu_plan.unsupported(layernorm)
    no_eps = model_of("spec_target_debug")
    no_eps.blocks[1].mlp.norm.eps = None  # F.rms_norm's default eps: the kernel does not take it
    assert "RMSNorm with a weight and an eps" in cpu_plan.unsupported(no_eps)
    before = len(runs)
    with torch.no_grad():
        layernorm(one, cache=layernorm.new_cache(2, 64))
    assert len(runs) == before


def test_a_dropout_that_would_drop_sends_the_pass_to_the_module_path(runs):
    model = model_of("spec_target_debug", **{"model.dropout": 0.5})
    one = torch.randint(0, model.vocab_size, (1, 1))
    with torch.no_grad():
        model(one, cache=model.new_cache(1, 16))
        assert runs == [(1, 1)]
        model.blocks[1].mlp.fn.drop.train()  # this module drops, though the model is in eval
        model(one, cache=model.new_cache(1, 16))
        assert runs == [(1, 1)]


def test_a_forward_hook_set_after_the_plan_was_made_runs(runs):
    """A hook set on any module the pass calls (or on every module) after the plan was made: the module path runs
    the pass, and the hook sees it; removed, the plan runs again."""
    model = model_of("spec_target_debug")
    one = torch.randint(0, model.vocab_size, (1, 1))
    seen = []
    with torch.no_grad():
        model(one, cache=model.new_cache(1, 16))
        assert len(runs) == 1
        for register in (model.blocks[1].mlp.fn.up.register_forward_hook,
                         model.blocks[0].attn.norm.register_forward_pre_hook,
                         nn.modules.module.register_module_forward_hook):
            hook = register(lambda *args: seen.append(len(args)))
            model(one, cache=model.new_cache(1, 16))
            assert len(runs) == 1 and seen, register
            seen.clear()
            hook.remove()
            model(one, cache=model.new_cache(1, 16))
            assert len(runs) == 2 and not seen
            runs.pop()


def test_replaced_weights_and_modules_and_a_type_change_are_seen_at_the_next_pass(runs):
    model = model_of("spec_target_debug")
    tokens = torch.randint(0, model.vocab_size, (2, 3))

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            got = model(tokens, cache=model.new_cache(2, 16))
            with cpu_plan.disabled():
                return got, model(tokens, cache=model.new_cache(2, 16))

    got, want = both()
    assert torch.equal(got, want) and len(runs) == 1
    attn = model.blocks[0].attn.fn
    attn.q.weight = nn.Parameter(torch.randn_like(attn.q.weight))  # a weight replaced by assignment
    got, changed = both()
    assert torch.equal(got, changed) and not torch.equal(changed, want) and len(runs) == 2
    mlp = model.blocks[1].mlp.fn
    mlp.down = linear_cpu.Linear(mlp.down.in_features, mlp.down.out_features)  # a module replaced
    got, changed_again = both()
    assert torch.equal(got, changed_again) and not torch.equal(changed_again, changed) and len(runs) == 3
    with torch.no_grad():
        mlp.up.weight.mul_(2)  # changed in place: the plan holds the very tensors
    got, doubled = both()
    assert torch.equal(got, doubled) and not torch.equal(doubled, changed_again) and len(runs) == 4
    model.double()  # float64 weights: not the kernels' (the module path runs them, no error)
    with torch.no_grad():
        model(tokens, cache=model.new_cache(2, 16))
    assert len(runs) == 4
    model.float()
    got, back = both()
    assert torch.equal(got, back) and len(runs) == 5


def test_an_overflowing_pass_raises_as_the_module_path_does_and_leaves_the_same_cache(runs):
    model = model_of("spec_target_debug")
    feeds = [torch.randint(0, model.vocab_size, (2, 4)) for _ in range(3)]
    states = {}
    for mode in ("plan", "module"):
        cache = model.new_cache(2, 10)
        with torch.no_grad(), (cpu_plan.disabled() if mode == "module" else contextlib.nullcontext()):
            model(feeds[0], cache=cache)
            model(feeds[1], cache=cache)
            with pytest.raises(ValueError, match="overflow|exceeds"):
                model(feeds[2], cache=cache)
        states[mode] = [(layer.lengths, layer.k.clone()) for layer in cache.layers]
    for (pl, pk), (ml, mk) in zip(states["plan"], states["module"]):
        assert pl == ml and torch.equal(pk, mk)


def test_every_mlp_of_a_planned_model_takes_the_gelu_epilogue(monkeypatch):
    """The plan's feed-forward calls are the kernel's up projection with its GELU, then the down projection (a spy
    on the kernel module, as the module path's tests do)."""
    model = model_of("spec_target_debug")
    real = linear_cpu.kernel()
    gelus = set()

    class Spy:
        @staticmethod
        def linear(x, w, b, gelu=False):
            if gelu:
                gelus.add(w.data_ptr())
            return real.linear(x, w, b, gelu)

    monkeypatch.setattr(linear_cpu, "kernel", lambda: Spy)
    with torch.no_grad():
        model(torch.randint(0, model.vocab_size, (1, 1)), cache=model.new_cache(1, 8))
    assert gelus == {m.up.weight.data_ptr() for m in model.modules() if isinstance(m, MLP)}


def test_continuous_batching_through_the_plan_equals_it_through_the_module_path(runs):
    """The scheduler's mixed load (base and speculative rows, greedy, top-k and nucleus draws, arrivals while others
    run): every request's tokens and acceptance, step for step, the same with the plan as on the module path."""
    from efftx.serving.continuous import Scheduler
    from test_serve_continuous import MIXED, lm, run_rounds

    target, draft = lm(0, 2), lm(1, 1)
    outcomes = {}
    for mode in ("module", "plan"):
        with cpu_plan.disabled() if mode == "module" else contextlib.nullcontext():
            jobs = run_rounds(Scheduler(target, draft, max_rows=8), MIXED)
        assert all(job.done and job.failure is None for job in jobs)
        outcomes[mode] = [(job.tag, job.out, job.stats.accepted if job.speculative else None) for job in jobs]
        if mode == "module":
            assert not runs
    assert outcomes["plan"] == outcomes["module"]
    assert len(runs) > 20  # the decoding passes took the plan
