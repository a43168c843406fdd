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


def check_slots(model, cap: int = 40, batched: bool = True, tol: float = 1e-4) -> None:
    """Rows prefilled in two batches join :class:`~efftx.generation.decode.Slots` (two slots to begin with, so they
    grow twice), then, as continuous batching does: ranges of the slots step as one batched pass each (a middle
    range, all rows), rows change places (``swap``), a row leaves (the last row ``copy``-ed onto its slot, then
    ``truncate``), a range is rewound per row, the slots shrink once rows left, a new row joins, and all rows step
    again. Every row's logits, step by step, must be those it gets decoding alone (batch 1) with the same tokens and
    rewinds."""
    from efftx.generation.decode import Slots

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 2, 7, 3, 4)]
    history: list[list] = [[] for _ in prompts]  # per row: ("feed", token, logits) / ("rewind", n)
    with torch.no_grad():
        slots = Slots(model, cap, rows=2, batched=batched)
        where: list[int] = []  # slot -> row

        def join(rows: list[int]) -> None:
            state = Rows(model, len(rows), cap, batched)
            state.prefill([prompts[r] for r in rows])
            for i, r in enumerate(rows):
                slots.put(state, i, len(where))
                where.append(r)

        def step(a: int, b: int) -> None:
            tokens = torch.randint(0, 256, (b - a, 1), generator=g)
            calls = (view := slots.rows(a, b)).forward_calls
            out = view.forward(tokens)[:, -1]
            assert view.forward_calls - calls == 1  # one pass for the range
            for i in range(b - a):
                history[where[a + i]].append(("feed", int(tokens[i, 0]), out[i:i + 1]))

        join([0, 1])
        join([2, 3, 4])
        assert len(slots) == 5 and (not batched or slots.slots == 8)
        step(1, 4)
        step(0, 5)
        slots.swap(0, 3)
        where[0], where[3] = where[3], where[0]
        step(0, 2)
        slots.copy(4, 1)  # the row in slot 1 leaves: the last row takes its slot
        where[1] = where.pop()
        slots.truncate(4)
        counts = [1, 2, 0]
        slots.rows(0, 3).rewind(counts)
        for i, n in enumerate(counts):
            if n:
                history[where[i]].append(("rewind", n))
        if batched:  # 4 rows of 8 slots: nothing to give back; of 2 rows, half the slots go
            slots.shrink()
            assert slots.slots == 8
            step(0, 4)
            slots.copy(3, 0)  # two more rows leave: the one in slot 0 (the last row takes it), then the last
            where[0] = where.pop()
            where.pop()
            slots.truncate(2)
            slots.shrink()
            assert slots.slots == 4 and len(slots) == 2
        join([5])
        for _ in range(3):
            step(0, len(slots))
        for r, prompt in enumerate(prompts):
            alone = Rows(model, 1, cap, batched=True)
            alone.prefill([prompt])
            got, want = [], []
            for event in history[r]:
                if event[0] == "rewind":
                    alone.rewind([event[1]])
                    continue
                got.append(event[2])
                want.append(alone.forward(torch.tensor([[event[1]]]))[:, -1])
            assert got, f"row {r} never stepped"
            torch.testing.assert_close(torch.cat(got), torch.cat(want), rtol=tol, atol=tol,
                                       msg=lambda m: f"row {r} against the row alone: {m}")
