"""Shared by the backends' decoding tests: rows of a ragged, splittable cache taken apart and joined
(``efftx.generation.decode.Rows``, what continuous batching does) decode exactly as each row alone."""

from __future__ import annotations

import torch

from efftx.generation.decode import Rows, splittable


def check_split_and_join(model, lengths=(5, 11, 2, 7), cap: int = 40, before=(3, 2), joined: int = 5,
                         rewind=(1, 0, 3), rewind_after: int = 2, full: bool = True, tol: float = 1e-4) -> None:
    """Rows 0, 1 prefilled together (prompts of ``lengths``) and stepped ``before[0]`` tokens, rows 2, 3 another batch
    stepped ``before[1]``; then row 1 leaves and rows 3, 0, 2 (each at its own position) decode ``joined`` steps
    together, one batched forward pass per step, rewound per row by ``rewind`` after step ``rewind_after``. Every
    row's logits must be those it gets decoding alone (batch 1) and, with ``full``, those of the uncached forward."""
    assert model.supports_ragged and splittable(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    feed = torch.randint(0, 256, (4, max(before) + joined), generator=g)
    with torch.no_grad():
        first, second = Rows(model, 2, cap), Rows(model, 2, cap)
        assert first.batched
        got = [[x] for x in list(first.prefill(prompts[:2]).split(1)) + list(second.prefill(prompts[2:]).split(1))]
        done = [0] * 4
        for state, rows, steps in ((first, [0, 1], before[0]), (second, [2, 3], before[1])):
            for i in range(steps):
                out = state.forward(feed[rows, i:i + 1])[:, -1]
                for j, r in enumerate(rows):
                    got[r].append(out[j:j + 1])
                    done[r] += 1
        state = Rows.concat([second.select([1]), first.select([0]), second.select([0])])  # row 1 left
        order = [3, 0, 2]
        calls = state.forward_calls
        for step in range(joined):
            out = state.forward(torch.stack([feed[r, done[r]] for r in order])[:, None])[:, -1]
            for j, r in enumerate(order):
                got[r].append(out[j:j + 1])
                done[r] += 1
            if step == rewind_after:
                state.rewind(list(rewind))
                for r, n in zip(order, rewind):
                    del got[r][len(got[r]) - n:]
                    done[r] -= n
        assert state.forward_calls - calls == joined  # one batched pass per step
        for r in range(4):
            alone = Rows(model, 1, cap, batched=True)
            want = [alone.prefill([prompts[r]])] + [alone.forward(feed[r:r + 1, i:i + 1])[:, -1] for i in range(done[r])]
            torch.testing.assert_close(torch.cat(got[r]), torch.cat(want), rtol=tol, atol=tol,
                                       msg=lambda m: f"row {r} against the row alone: {m}")
            if full:
                seq = torch.tensor([prompts[r] + feed[r, :done[r]].tolist()])
                torch.testing.assert_close(torch.cat(got[r]), model(seq)[0, len(prompts[r]) - 1:], rtol=tol, atol=tol,
                                           msg=lambda m: f"row {r} against the uncached forward: {m}")
