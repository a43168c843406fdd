"""Compiled decoding (efftx.generation.compiled): same tokens as the eager path, fallbacks with their reasons.

The tests marked slow compile the decode step with inductor (tens of seconds of CPU for each batch size); they
share one tiny model and two shapes (batch 1 and 3, capacity 64), so the step compiles twice per module.
"""

from __future__ import annotations

import logging

import pytest
import torch

from device_waits import waits_of
from efftx import recipes
from efftx.errors import ConfigError
from efftx.generation import compiled
from efftx.generation.decode import generate, iter_generate
from efftx.models import build


def tiny(recipe: str = "lm_debug", **overrides):
    """A 2-layer model of ``recipe`` (GQA: 4 heads, 2 kv heads for lm_debug), fp32, eval mode. Its matrices are
    redrawn with std 2/sqrt(fan_in): under the training init (std 0.02) greedy tokens barely depend on the context
    (the same byte over and over), so a decoder that misplaces positions could still match."""
    torch.manual_seed(0)
    model = build(recipes.get(recipe).override({"model.depth": 2, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 2 * p.shape[1] ** -0.5)
    return model


@pytest.fixture(scope="module")
def lm():
    return tiny()


def prompts(batch: int, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(batch))


RAGGED = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]


# ------------------------------------------------------------------------------------------ options, fallbacks
def test_bad_compile_value_is_rejected_naming_the_key(lm):
    with pytest.raises(ConfigError, match="compile='yes'.*'auto', 'on', 'off'"):
        generate(lm, prompts(1), 2, compile="yes")
    with pytest.raises(ConfigError, match="compile=True"):
        list(iter_generate(lm, prompts(1), 2, compile=True))


@pytest.mark.parametrize("recipe, kind", [("sinkhorn_debug", "sinkhorn"), ("performer_debug", "performer")])
def test_unsupported_backend_decodes_eagerly_and_logs_why(recipe, kind, caplog):
    model = tiny(recipe)
    assert kind in compiled.unsupported_reason(model)
    with caplog.at_level(logging.INFO, logger="efftx.generation.compiled"):
        auto = generate(model, prompts(2), 5, temperature=0.0, compile="auto")
    assert any(kind in r.getMessage() and "eagerly" in r.getMessage() for r in caplog.records)
    assert torch.equal(auto, generate(model, prompts(2), 5, temperature=0.0))  # the eager path, untouched


def test_compile_on_for_an_unsupported_model_raises_naming_why():
    with pytest.raises(compiled.CompileUnavailable, match="compile='on'.*attention.kind='sinkhorn'"):
        generate(tiny("sinkhorn_debug"), prompts(1), 3, compile="on")
    training = tiny()  # training mode: dropout would make the two paths differ
    training.train()
    with pytest.raises(compiled.CompileUnavailable, match="training mode"):
        generate(training, prompts(1), 3, compile="on")


def test_a_failing_compile_falls_back_under_auto_and_raises_under_on(lm, caplog, break_compile):
    break_compile()
    with pytest.raises(compiled.CompileUnavailable, match="torch.compile of the decode step failed.*no C\\+\\+"):
        generate(lm, prompts(2), 4, temperature=0.0, compile="on")
    eager = generate(lm, prompts(2), 4, temperature=0.0)
    with caplog.at_level(logging.WARNING, logger="efftx.generation.compiled"):
        assert torch.equal(generate(lm, prompts(2), 4, temperature=0.0, compile="auto"), eager)
    assert any("no C++ compiler" in r.getMessage() for r in caplog.records)
    # remembered: the next "auto" call does not try again, and says why
    with caplog.at_level(logging.INFO, logger="efftx.generation.compiled"):
        assert torch.equal(generate(lm, prompts(2), 4, temperature=0.0, compile="auto"), eager)
    assert any("failed earlier" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------ the device cache
def test_device_cache_steps_match_eager_without_compiling(lm, monkeypatch):
    """The static-shape step (whole-capacity attention, device lengths) run eagerly: same tokens, ragged too."""
    monkeypatch.setattr(compiled, "compiled_function", lambda fn, device_type: fn)
    for rows in (prompts(1), prompts(3), RAGGED):
        eager = generate(lm, rows, 10, temperature=0.0)
        assert eager.unique().numel() > 3  # tokens that depend on the context
        assert torch.equal(generate(lm, rows, 10, temperature=0.0, compile="on"), eager)
        assert torch.equal(generate(lm, rows, 10, temperature=0.8, top_k=40, seed=7, compile="on"),
                           generate(lm, rows, 10, temperature=0.8, top_k=40, seed=7))


def test_device_lengths_advance_on_the_device_and_buffers_are_reused(lm, monkeypatch):
    monkeypatch.setattr(compiled, "compiled_function", lambda fn, device_type: fn)
    first = iter_generate(lm, RAGGED, 5, temperature=0.0, compile="on")
    next(first)  # prefilled, nothing fed yet
    for _ in range(4):
        next(first)  # 4 tokens fed
    first.close()  # the buffers go back to the pool
    key = (3, compiled.capacity_for(lm, 9 + 5 - 1), torch.float32, torch.device("cpu"))
    (cache,) = compiled._POOLS[lm][key]
    assert cache.lengths.tolist() == [3 + 4, 9 + 4, 1 + 4]
    again = iter_generate(lm, RAGGED, 2, temperature=0.0, compile="on")
    next(again)
    assert compiled._POOLS[lm][key] == []  # in use by the second call
    again.close()
    assert compiled._POOLS[lm][key] == [cache]


def assert_passes_match_eager(lm, passes, transposed: bool = False):
    """Run (token count, per-row rewind) passes through a StaticDecoder and the eager ragged cache side by side:
    the same logits and lengths after each. ``transposed``: tokens given as a transposed (column-major) view."""
    from efftx.generation.decode import Rows

    eager = Rows(lm, 3, 64)
    eager.prefill(RAGGED)
    static = compiled.StaticDecoder(lm, 3, 64, True, "on")
    try:
        static.load(eager.caches[0], eager.lengths)
        g = torch.Generator().manual_seed(0)
        for t, counts in passes:
            tokens = torch.randint(0, 256, (t, 3), generator=g).T if transposed else \
                torch.randint(0, 256, (3, t), generator=g)
            torch.testing.assert_close(static.forward(tokens), eager.forward(tokens))
            static.rewind(counts)
            eager.rewind(counts)
            assert static.lengths == eager.lengths == static.cache.lengths.tolist()
        with pytest.raises(ValueError, match="cannot rewind 40 tokens"):
            static.rewind([40, 0, 0])
        with pytest.raises(ValueError, match="cache overflow"):
            static.forward(torch.zeros(3, 64, dtype=torch.long))
    finally:
        static.release()


def test_multi_token_passes_and_per_row_rewinds_match_eager_rows(lm, monkeypatch):
    """StaticDecoder.forward (T tokens per row, each row at its own device position) and rewind (a count per row,
    one subtraction on the device lengths), speculative decoding's verify pass and rejection, give the eager
    ragged cache's logits, pass after pass; a pass past the capacity and a bad rewind are clear errors."""
    monkeypatch.setattr(compiled, "compiled_function", lambda fn, device_type: fn)
    assert_passes_match_eager(lm, ((4, [3, 0, 4]), (1, [1, 1, 0]), (6, [2, 5, 6]), (3, [0, 0, 0])))


# ------------------------------------------------------------------------------------------ compiled (slow)
@pytest.fixture(scope="module")
def compiled_counts(lm):
    """Compile once per shape used below (batch 1 and 3, capacity 64) and count the graphs dynamo made."""
    from torch._dynamo.utils import counters

    counters.clear()
    generate(lm, prompts(1), 3, temperature=0.0, compile="on")
    generate(lm, prompts(3), 3, temperature=0.0, compile="on")
    return counters


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_greedy_and_seeded_sampling_equal_eager(lm, compiled_counts, batch):
    rows = prompts(batch)
    eager = generate(lm, rows, 16, temperature=0.0)
    assert eager.unique().numel() > 3  # tokens that depend on the context, not one byte repeated
    assert torch.equal(generate(lm, rows, 16, temperature=0.0, compile="on"), eager)
    for seed in (0, 1):
        assert torch.equal(generate(lm, rows, 16, temperature=0.9, top_k=50, top_p=0.95, seed=seed, compile="on"),
                           generate(lm, rows, 16, temperature=0.9, top_k=50, top_p=0.95, seed=seed))


@pytest.mark.slow
def test_compiled_ragged_prompts_equal_eager_without_recompiling(lm, compiled_counts):
    graphs = compiled_counts["stats"]["unique_graphs"]
    assert torch.equal(generate(lm, RAGGED, 20, temperature=0.0, compile="on"),
                       generate(lm, RAGGED, 20, temperature=0.0))
    # other prompt lengths and token counts in the same capacity: the same compiled graph
    assert torch.equal(generate(lm, prompts(3, 20), 30, temperature=0.0, compile="auto"),
                       generate(lm, prompts(3, 20), 30, temperature=0.0))
    assert compiled_counts["stats"]["unique_graphs"] == graphs
    assert graphs == 2  # one per batch size, no graph break (fullgraph=True would raise anyway)


@pytest.mark.slow
def test_compiled_passes_of_new_shapes_and_strides_after_guard_light_calls(lm):
    """After its first guarded call of a shape a decoder skips most of dynamo's guards; a pass of another token count
    still compiles its own graph (and runs it correctly) rather than reusing or refusing one, and tokens given as
    a transposed view run as a row-major copy through the same graphs: two graphs for the two counts."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    assert_passes_match_eager(lm, ((4, [4, 4, 4]), (4, [3, 0, 4]), (1, [0, 1, 0]), (4, [2, 1, 1]), (1, [1, 0, 0])))
    assert_passes_match_eager(lm, ((4, [4, 4, 4]), (1, [0, 1, 0])), transposed=True)
    assert counters["stats"]["unique_graphs"] - before == 2


def test_generate_cli_takes_compile_and_names_why_it_cannot(monkeypatch, capsys):
    """``python -m efftx.generate --compile on`` where compiled decoding cannot run: exit 2 with the reason;
    ``--compile auto`` decodes eagerly then, with the same text as ``--compile off``."""
    from pathlib import Path

    from efftx import generate as cli

    export = str(Path(__file__).parent / "data" / "export_v0")
    base = ["--model", export, "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0", "--device", "cpu"]
    monkeypatch.setattr(compiled, "unsupported_reason", lambda model: "a reason the test gives")
    assert cli.main([*base, "--compile", "on"]) == 2
    assert "a reason the test gives" in capsys.readouterr().err
    assert cli.main([*base, "--compile", "off"]) == 0
    off = capsys.readouterr().out
    assert cli.main([*base, "--compile", "auto"]) == 0
    assert capsys.readouterr().out == off
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*base, "--compile", "yes"])
    assert exit_info.value.code == 2 and "invalid choice: 'yes'" in capsys.readouterr().err


def test_every_thread_that_compiles_raises_dynamos_recompile_limit_for_itself():
    """dynamo's settings are per thread: a Serve replica warms up (and compiles) in its main thread and decodes in
    another, where the default limit (8 graphs per function) would fail new shapes with fullgraph=True."""
    import threading

    seen = []

    def decoding_thread():
        compiled.compiled_function(compiled.forward_step, "cpu")  # no compilation yet: only the function
        seen.append(torch._dynamo.config.recompile_limit)

    thread = threading.Thread(target=decoding_thread)
    thread.start()
    thread.join()
    assert len(seen) == 1 and seen[0] >= compiled.RECOMPILE_LIMIT


def test_compiled_outputs_handled_as_on_cuda_keep_speculative_decodings_tokens(lm, monkeypatch):
    """On CUDA a compiled call's outputs are cloned (a graph's next replay overwrites them): speculative decoding's
    draft steps return (tokens, None) when greedy, which must pass through. The passes run eagerly here, their
    outputs handled as on CUDA: greedy and sampled, fixed and adaptive gamma, the eager tokens."""
    from efftx.generation.speculative import speculative_generate

    monkeypatch.setattr(compiled, "compiled_function", lambda fn, device_type: fn)
    real_init = compiled.CompiledRunner.__init__

    def as_on_cuda(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.device_type = "cuda"

    monkeypatch.setattr(compiled.CompiledRunner, "__init__", as_on_cuda)
    draft = tiny(**{"model.depth": 1})
    for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 40, "seed": 3}):
        for adaptive in (False, True):
            extra = {"adaptive_gamma": adaptive, "max_gamma": 6 if adaptive else None, **sampling}
            eager = speculative_generate(lm, draft, RAGGED, 12, gamma=3, **extra)
            assert speculative_generate(lm, draft, RAGGED, 12, gamma=3, compile="on", **extra)[0] == eager[0]
    assert compiled.owned((torch.ones(2), None))[1] is None


def test_an_eager_pass_over_the_device_cache_reads_nothing_back_from_the_device(lm, monkeypatch):
    """After a compile failure under ``auto`` a decoder runs its passes eagerly over the same device cache: those
    passes read no device value back to the host (on a GPU each read waits for every queued kernel), its rotary's
    position check included (the decoder checks positions against its capacity, at most max_seq_len, on the host).
    Power: the per-layer check that reads the device positions fails it."""
    from efftx.generation.decode import Rows

    eager = Rows(lm, 3, 64)
    eager.prefill(RAGGED)
    static = compiled.StaticDecoder(lm, 3, 64, False, "auto")  # what a runner is after a compile failure
    try:
        static.load(eager.caches[0], eager.lengths)
        tokens = torch.randint(0, 256, (3, 2), generator=torch.Generator().manual_seed(1))

        def passes():
            with torch.no_grad():
                return static.forward(tokens), static(tokens[:, 0])
        (out, step), waits = waits_of(passes)
        assert waits == []
        torch.testing.assert_close(out, eager.forward(tokens))
        torch.testing.assert_close(step, eager.forward(tokens[:, :1])[:, -1])
    finally:
        static.release()
    with pytest.raises(ValueError, match=f"of {2 * lm.max_seq_len} positions exceeds the model's max_seq_len"):
        compiled.StaticDecoder(lm, 1, 2 * lm.max_seq_len, False, "auto")  # its bound would not hold
