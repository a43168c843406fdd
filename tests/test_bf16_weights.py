"""Weight-only bfloat16 decoding on a CPU (efftx.kernels.linear_cpu.bf16_weights): the linear kernel with bfloat16
weights is, bit for bit, the float32 kernel on the widened weights over many shapes; a model whose Linear weights
were cast decodes exactly as the float32 model whose Linear weights were rounded to bfloat16 (eager passes, the CPU
plan, the module path and compiled graphs), greedy speculative decoding still equals base decoding, and the CLI and
the text app take it as an option and refuse it where it does not apply."""

from __future__ import annotations

import contextlib
import copy
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from efftx import recipes
from efftx.errors import ExportError
from efftx.generation.decode import generate
from efftx.generation.speculative import speculative_generate
from efftx.kernels import linear_cpu
from efftx.models import build, cpu_plan

MODULE = linear_cpu.kernel()
SHAPES = [(k, n) for k in (1, 7, 16, 17, 40, 100, 512) for n in (1, 3, 4, 5, 11, 64, 257)]
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 19)  # past 4 rows the bfloat16 weights are widened into scratch first


def test_the_kernel_builds_here():
    assert MODULE is not None, linear_cpu.KERNEL.load()[1]


@pytest.mark.parametrize("k,n", SHAPES)
def test_bf16_weights_give_the_float32_kernels_result_on_the_widened_weights(k, n):
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    wide = w.float()  # exact: a bfloat16 is the top half of a float32
    b = torch.randn(n, generator=g)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        for bias in (None, b):
            for gelu in (False, True):
                got = MODULE.linear(x, w, bias, gelu)
                assert torch.equal(got, MODULE.linear(x, wide, bias, gelu)), (rows, bias is None, gelu)
            want = F.linear(x.double(), wide.double(), None if bias is None else bias.double()).float()
            torch.testing.assert_close(MODULE.linear(x, w, bias), want, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_a_rows_result_with_bf16_weights_is_the_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 200, generator=g).bfloat16()
    x = torch.randn(16, 200, generator=g)
    alone = torch.cat([MODULE.linear(x[i:i + 1], w, None, True) for i in range(16)])
    for rows in range(2, 17):
        assert torch.equal(MODULE.linear(x[:rows], w, None, True), alone[:rows]), rows


def test_which_bf16_calls_take_the_kernel_and_the_widened_fallback():
    w = torch.randn(16, 32).bfloat16()
    x = torch.randn(2, 32)
    assert linear_cpu.takes(x, w)
    assert not linear_cpu.takes(x.bfloat16(), w)  # weight-only: the activations stay float32
    assert not linear_cpu.takes(x, torch.randn(16, 32).half())
    many = torch.randn(linear_cpu.MAX_ROWS + 1, 32)
    assert torch.equal(linear_cpu.linear(many, w), F.linear(many, w.float()))  # past MAX_ROWS: widened, F.linear
    with linear_cpu.disabled():
        assert torch.equal(linear_cpu.linear(x, w, gelu=True), F.gelu(F.linear(x, w.float())))


def _rounded(model):
    """A float32 copy of ``model`` whose Linear weights were rounded to bfloat16 and back."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for m in twin.modules():
            if isinstance(m, linear_cpu.Linear):
                m.weight.copy_(m.weight.bfloat16().float())
    return twin


def test_bf16_weights_cast_the_linear_weights_only_and_refuse_what_does_not_apply():
    cfg = recipes.get("lm_debug")
    torch.manual_seed(0)
    model = build(cfg).eval()
    linears = [m for m in model.modules() if isinstance(m, linear_cpu.Linear)]
    assert linear_cpu.bf16_weights(model) == len(linears) > 0
    for name, p in model.named_parameters():
        is_linear_weight = any(p is m.weight for m in linears)
        assert p.dtype == (torch.bfloat16 if is_linear_weight else torch.float32), name
    assert all(not m.weight.requires_grad for m in linears)
    assert linear_cpu.use_weights(model, "float32") is model  # float32 leaves the model as it is
    with pytest.raises(ValueError, match="weights must be one of float32, bfloat16, got 'int8'"):
        linear_cpu.use_weights(model, "int8")
    with pytest.raises(ValueError, match="CPU decoding option.*meta"):
        linear_cpu.bf16_weights(build(cfg).to("meta"))
    with pytest.raises(ValueError, match="need float32 Linear weights"):
        linear_cpu.bf16_weights(build(cfg).half())


@pytest.mark.parametrize("path", ["plan", "modules", "no kernel"])
def test_decoding_with_bf16_weights_is_decoding_with_the_rounded_float32_weights(path, monkeypatch):
    """Greedy and sampled decoding of a batch: the same tokens from the cast model as from the float32 model with
    rounded weights, on each path a pass may take (spies see the CPU plan run, or the kernel get bfloat16 weights)."""
    cfg = recipes.get("lm_debug")
    torch.manual_seed(0)
    model = build(cfg).eval()
    twin = _rounded(model)
    linear_cpu.bf16_weights(model)
    assert cpu_plan.unsupported(model) is None
    prompts = torch.randint(0, cfg.model.vocab_size, (3, 20), generator=torch.Generator().manual_seed(3))
    off = {"plan": [], "modules": [cpu_plan.disabled], "no kernel": [linear_cpu.disabled]}[path]

    def run(m, **sampling):
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for ctx in off:
                stack.enter_context(ctx())
            return generate(m, prompts, 12, **sampling)

    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 20, "seed": 4}):
        want = run(twin, **sampling)
        seen, plans = [], []
        real, real_run = MODULE.linear, cpu_plan.CpuPlan.run

        class Spy:
            @staticmethod
            def linear(x, w, b, gelu=False):
                seen.append(w.dtype)
                return real(x, w, b, gelu)

        def plan_run(self, tokens, cache, kernels):
            plans.append(self.layers[0][2].dtype)  # the first block's q weight
            return real_run(self, tokens, cache, kernels)

        with monkeypatch.context() as patch:
            patch.setattr(linear_cpu, "kernel", lambda: Spy)
            patch.setattr(cpu_plan.CpuPlan, "run", plan_run)
            got = run(model, **sampling)
        assert torch.equal(got, want), (path, sampling)
        if path == "plan":
            assert plans and set(plans) == {torch.bfloat16}
        else:
            assert not plans
            assert (torch.bfloat16 in seen) == (path == "modules")


def test_greedy_speculative_with_bf16_weights_equals_base():
    cfg = recipes.get("lm_debug").override({"model.depth": 2})
    torch.manual_seed(0)
    target = build(cfg).eval()
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(2.0)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * p.abs().mean().clamp_min(1e-3))
    for m in (target, draft):
        linear_cpu.bf16_weights(m)
    prompts = [[10, 20, 30, 40, 50], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    spec, stats = speculative_generate(target, draft, prompts, 30, gamma=5, temperature=0)
    for prompt, row in zip(prompts, spec):
        assert row == generate(target, torch.tensor([prompt]), 30, temperature=0)[0].tolist()
    assert 0 < stats.mean_accepted < 5  # drafts both accepted and rejected


def test_compiled_graphs_take_bf16_weights_through_the_operator():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(any(str(node.target).startswith("efftx.cpu_linear") for node in gm.graph.nodes))
        return gm.forward

    layer = linear_cpu.Linear(40, 24)
    want_layer = copy.deepcopy(layer)
    linear_cpu.bf16_weights(layer)
    with torch.no_grad():
        want_layer.weight.copy_(layer.weight.float())
    fn = torch.compile(lambda x: layer(x, gelu=True), backend=capture, fullgraph=True, dynamic=False)
    x = torch.randn(3, 40)
    with torch.no_grad():
        assert torch.equal(fn(x), want_layer(x, gelu=True)) and graphs[-1]


def test_compiled_decoding_with_bf16_weights_gives_the_eager_tokens():
    """torch.compile'd base decoding and speculative passes (efftx.generation.compiled) over bfloat16 weights: the
    tokens of eager decoding, and greedy speculative equal to greedy base."""
    torch.manual_seed(0)
    target = build(recipes.get("spec_target_debug")).eval()
    torch.manual_seed(1)
    draft = build(recipes.get("spec_draft_debug")).eval()
    for m in (target, draft):
        linear_cpu.bf16_weights(m)
    prompts = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(2))
    eager = generate(target, prompts, 12, temperature=0)
    assert torch.equal(generate(target, prompts, 12, temperature=0, compile="on"), eager)
    spec, _ = speculative_generate(target, draft, prompts.tolist(), 12, gamma=3, temperature=0, compile="on")
    assert spec == eager.tolist()


EXPORT = str(Path(__file__).parent / "data" / "export_v0")


def test_the_generate_cli_takes_weights_and_refuses_bad_ones(capsys):
    from efftx import generate as cli

    args = ["--model", EXPORT, "--prompt", "ab", "--max-new-tokens", "8", "--temperature", "0", "--device", "cpu"]
    assert cli.main([*args, "--weights", "bfloat16"]) == 0
    assert capsys.readouterr().out.startswith("ab")
    with pytest.raises(SystemExit) as exc:
        cli.main([*args, "--weights", "int4"])
    assert exc.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ExportError, match="CPU decoding option; got --device cuda"):
        cli.sample_text(EXPORT, "ab", 4, device="cuda", weights="bfloat16")


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_the_text_app_holds_bf16_weights_and_decodes_as_the_rounded_model(debug_exports, engine):
    from efftx.export import load_export
    from efftx.serving.app_args import TextAppArgs
    from efftx.serving.batches import Sampling
    from efftx.serving.continuous import Job
    from efftx.serving.text import TextGenerator, build as build_app

    args = TextAppArgs(target=debug_exports["target"], decode_weights=" BFloat16 ")
    assert args.decode_weights == "bfloat16"
    assert build_app(args)._bound_deployment.init_kwargs["weights"] == "bfloat16"
    assert "weights" not in build_app(TextAppArgs(target="/nowhere"))._bound_deployment.init_kwargs
    with pytest.raises(ValueError, match="decode_weights"):
        TextAppArgs(target="/nowhere", decode_weights="fp8")
    cls = TextGenerator.func_or_class.__bases__[0]  # the app's own class, under Serve's ingress wrapper
    replica = cls(debug_exports["target"], debug_exports["draft"], name="tiny", warm_up_rows=1, weights="bfloat16",
                  engine=engine)
    try:
        # engine=process: the cards say what the decoding process holds (the replica's own models are skeletons)
        assert [card.details["linear_weights"] for card in replica.model_cards] == ["bfloat16", "bfloat16"]
        assert [card.device for card in replica.model_cards] == ["cpu", "cpu"]
        assert replica.model_cards[0].parameters == sum(p.numel() for p in load_export(debug_exports["target"])[0]
                                                        .parameters())
        target, _, _ = load_export(debug_exports["target"], torch.device("cpu"))
        prompt = [5, 6, 7, 8]
        want = generate(_rounded(target.eval()), torch.tensor([prompt]), 10, temperature=0)[0].tolist()
        done = threading.Event()
        for gamma in (None, 3):  # base and speculative rows of the replica's scheduler
            done.clear()
            job = replica.scheduler.submit(Job(prompt, 10, Sampling(0.0), gamma=gamma, on_done=lambda j: done.set()))
            assert done.wait(120) and job.error is None and job.failure is None
            assert job.out == want, gamma
    finally:
        replica.scheduler.close()
