"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a draft proposes, the target verifies.

One step, for one sequence whose caches hold every token but the last ("pending") one:

1. the draft decodes ``gamma`` tokens x_1..x_gamma one at a time, keeping its distributions q_i;
2. the target scores ``[pending, x_1..x_gamma]`` in one forward pass: distributions p_1..p_{gamma+1};
3. x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a token is drawn
   from the normalised residual max(0, p_i - q_i) and the step ends; if all are accepted a bonus token is
   drawn from p_{gamma+1};
4. both caches are rewound past the rejected tokens.

Every emitted token is distributed exactly as the target would sample it; with greedy settings
(temperature 0) the output is token for token the target's greedy output. Batches run together with
per-row acceptance: each row rewinds its own caches, so rows advance by their own acceptance and
never see each other's tokens (see :func:`iter_speculative_rows`).

Adaptive gamma (``adaptive_gamma=True``): each row drafts its own number of tokens, from its recent
acceptance: one more after a step that accepted all its drafts, one fewer after a rejection, between 1 and
``max_gamma``. A batched step drafts as many tokens as its longest row needs; a row verifies only its own
(the extra draft tokens are rewound). Which tokens are proposed never changes what is emitted (the
acceptance rule is exact for any gamma), only how many target passes it takes.

**The batched step** keeps the per-token work on the device: draft tokens are drawn on the device
(:func:`~efftx.generation.sampling.draw`; greedy decoding takes argmaxes and skips the distributions altogether), every row's acceptance
comes from one comparison of its uniforms with its ratios p/q (:func:`accepted_counts`), its last token (residual or
bonus, :func:`correction`) is drawn for all rows at once, and the host reads one small tensor per step (accepted
counts, last tokens, drafts) to yield the tokens and size the per-row rewinds. Row r's randomness comes only from
its own generator, one draw per step (:func:`step_noise`: the races of its drafts and of its last token, and its
acceptance uniforms, in one block; continuous batching makes the same draw per row, with :func:`accept_sampled`),
so a row gets the tokens it gets decoded alone, whatever its batch. Since no draw depends on the passes, a step
draws first, and the passes take the noise as tensors (one call per row and step, where a draw per drafted token
took ``gamma + 2``: on a GPU each is a kernel launch). ``compile="on"`` runs the draft steps with their draws
(with a fixed gamma all of a step's drafts in one graph, :func:`draft_steps`) and the target's verify pass with
the acceptance (:func:`verify_step`) compiled over preallocated caches with device-side lengths
(:mod:`efftx.generation.compiled`), with the eager path as the fallback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from efftx.generation import compiled
from efftx.generation.decode import Rows, as_rows, generators, splittable
from efftx.generation.draft_length import DraftLength
from efftx.generation.sampling import (Stream, draw, is_greedy, position_noise, probabilities, race,
                                      stream_noise)
from efftx.host import host_values
from efftx.kernels import sampling_cpu


@dataclass
class SpecStats:
    """Acceptance statistics of a speculative run."""

    gamma: int
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per step
    drafted: list[int] = field(default_factory=list)  # draft tokens verified per step (gamma, or a row's own)
    draft_calls: int = 0  # draft forward passes
    target_calls: int = 0  # target forward passes (the prefill included)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified draft tokens."""
        return sum(self.accepted) / sum(self.drafted) if sum(self.drafted) else 0.0

    @property
    def histogram(self) -> list[int]:
        """histogram[n] = steps in which exactly n draft tokens were accepted (n = 0..gamma)."""
        counts = [0] * (self.gamma + 1)
        for n in self.accepted:
            counts[n] += 1
        return counts

    def result_fields(self) -> dict:
        """The acceptance fields of a serving result (ModeResult, StreamDone)."""
        return {"mean_accepted": self.mean_accepted, "acceptance_histogram": self.histogram,
                "draft_calls": self.draft_calls, "target_calls": self.target_calls}

    def to_dict(self) -> dict:
        return {"gamma": self.gamma, "steps": self.steps, "mean_accepted": self.mean_accepted,
                "histogram": self.histogram, "draft_calls": self.draft_calls, "target_calls": self.target_calls}


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dimension; where p <= q everywhere (only possible when p == q), p itself."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def step_noise(generators: list[torch.Generator | Stream | None], own: Sequence[int], width: int, vocab: int,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every random number of a sampled speculative step, in one draw per row: row b, which verifies ``own[b]``
    drafts (0: a finished row, which draws nothing), fills the first ``own[b] + 1`` rows of its
    (``width`` + 1, ``vocab`` + 1) block of Exp(1) noise with its generator's next draw: a
    :class:`~efftx.generation.sampling.Stream`'s (every stream row in one call; the values of a draw's first
    elements do not depend on how many it has), or one ``exponential_`` call from a ``torch.Generator`` (None: the
    global RNG). Its row i < ``own[b]`` holds the race noise of its draft i (the first ``vocab`` columns,
    :func:`~efftx.generation.sampling.race`) and, as exp(-E) (uniform on (0, 1]), the acceptance uniform of that
    draft (the last column); its row ``own[b]`` the race noise of its last token. What a row draws depends only on
    its generator and its own count, never on the batch around it. Returns (draft noise (width, B, V), uniforms
    (B, width), last-token noise (B, V)); the values past a row's own drafts are never read (1, or another draw of
    the row's block)."""
    rows = len(generators)
    if rows and all(isinstance(g, Stream) for g in generators):
        block = stream_noise([g if n else None for g, n in zip(generators, own)], (width + 1) * (vocab + 1), device)
        block = block.view(rows, width + 1, vocab + 1)
    else:
        block = torch.ones(rows, width + 1, vocab + 1, device=device)
        if all(g is None for g in generators):
            block.exponential_()
        else:
            for b, (g, n) in enumerate(zip(generators, own)):
                if n:
                    if isinstance(g, Stream):
                        block[b] = stream_noise([g], (width + 1) * (vocab + 1), device).view(width + 1, vocab + 1)
                    else:
                        block[b, :n + 1].exponential_(generator=g)
    at = host_values(list(own), torch.long, device)
    return (block[:, :width, :vocab].transpose(0, 1).contiguous(), torch.exp(-block[:, :width, vocab]),
            block[torch.arange(rows, device=device), at, :vocab])


def accepted_counts(accept: torch.Tensor) -> torch.Tensor:
    """(B, G) per-draft acceptance -> (B,) accepted drafts: the leading run of True per row."""
    return accept.long().cumprod(-1).sum(-1)


def correction(p: torch.Tensor, q: torch.Tensor, n: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The distribution of each row's last token of a step: p: (B, G + 1, V) target, q: (B, G, V) draft
    distributions, n: (B,) accepted drafts, full: (B,) whether a row accepted all its drafts. A row that
    accepted all draws its bonus token from p_{n+1}; one rejected at draft n+1 draws from norm(max(0, p - q))
    there (:func:`residual`)."""
    rows = torch.arange(p.shape[0], device=p.device)
    p_n = p[rows, n]
    q_n = q[rows, n.clamp_max(q.shape[1] - 1)]
    return torch.where(full[:, None], p_n, residual(p_n, q_n))


def draft_pick(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float, top_k: int,
               top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft step's (B, V) logits -> (tokens (B,), distributions q (B, V)): drawn with the step's
    noise (:func:`step_noise`), or greedy (``noise`` None: the argmax, no distribution)."""
    if noise is None:
        return logits.argmax(-1), None
    q = probabilities(logits, temperature, top_k, top_p)
    return race(q, noise), q


def accept(t_logits: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor | None, u: torch.Tensor | None,
           noise: torch.Tensor | None, own: torch.Tensor, temperature: float, top_k: int,
           top_p: float) -> torch.Tensor:
    """Every row's acceptance of a step, on the device: (B, G + 1, V) target logits of [pending, drafts],
    (B, G) drafts, (B, G, V) their distributions q, (B, G) uniforms, (B, V) noise of the last token, (B,) the
    drafts each row verifies (its own gamma; 0 for a finished row; the drafts past it are padding or another
    row's) -> (B, G + 2): accepted count, last token (residual or bonus), the drafts. Greedy: q, u, noise None
    (p and q are one-hot: x_i is accepted iff it is the target's argmax, which is also the last token)."""
    if q is None:
        return agreed(t_logits.argmax(-1), drafted, own)
    return accept_sampled(probabilities(t_logits, temperature, top_k, top_p), q, drafted, u, noise, own)


def agreed(best: torch.Tensor, drafted: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Acceptance where the target's token at every position is known: (B, G + 1) the target's tokens at [pending,
    drafts], (B, G) drafts, (B,) drafts each row verifies -> (B, G + 2) as :func:`accept`: x_i accepted while it is
    the target's token there; the last token is the target's at the first disagreement (or its bonus)."""
    g = drafted.shape[1]
    within = torch.arange(g, device=drafted.device) < own[:, None]
    n = accepted_counts((drafted == best[:, :g]) & within)
    last = best.gather(1, n[:, None])[:, 0]
    return torch.cat([n[:, None], last[:, None], drafted], 1)


def accept_coupled(p: torch.Tensor, drafted: torch.Tensor, noise: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """*Coupled* acceptance: (B, G + 1, V) target distributions at [pending, drafts], (B, G) drafts, (B, G + 1, V) the
    noise of those positions (:func:`~efftx.generation.sampling.position_noise`), (B,) drafts each row verifies ->
    (B, G + 2) as :func:`accept`. The target's token at each position is its race with that position's noise, the
    token base decoding draws there with the same stream; a draft, raced by the draft with the same noise, is accepted
    while it is that token (:func:`agreed`). So every emitted token is base decoding's, whatever the draft, gamma or
    batch; a draft is accepted a little less often than by :func:`accept_sampled`'s ratio test (the small pair at
    temperature 0.8, gamma 5, 32 corpus prompts: 2.23 against 2.42 accepted drafts a step)."""
    return agreed(coupled_tokens(p, noise), drafted, own)


def coupled_tokens(p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(B, G + 1, V) distributions and their positions' noise -> (B, G + 1) the tokens they race to."""
    b, width, v = p.shape
    return race(p.reshape(b * width, v), noise.reshape(b * width, v)).view(b, width)


def agreed_row(best: Sequence[int], drafted: Sequence[int], own: int) -> list[int]:
    """:func:`agreed` for one row on the host: its target tokens, drafts and own count -> [accepted, last, *drafts]."""
    n = 0
    while n < own and drafted[n] == best[n]:
        n += 1
    return [n, best[n], *drafted]


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, u: torch.Tensor, noise: torch.Tensor,
                   own: torch.Tensor) -> torch.Tensor:
    """:func:`accept` from the target's distributions p (B, G + 1, V) (continuous batching computes them per row's
    sampling settings): x_i accepted while u_i < p_i(x_i) / q_i(x_i), then the last token by its race from
    :func:`correction` -> (B, G + 2): accepted count, last token, the drafts (float32 CPU tensors: in one call of the
    C++ kernel, :func:`efftx.kernels.sampling_cpu.accept`)."""
    fused = sampling_cpu.accept(p, q, drafted, u, noise, own)
    if fused is not None:
        return fused
    g = drafted.shape[1]
    within = torch.arange(g, device=drafted.device) < own[:, None]
    picked = drafted[..., None]
    ratio = (p[:, :g].gather(-1, picked) / q.gather(-1, picked).clamp_min(1e-30))[..., 0]
    n = accepted_counts((u < ratio) & within)  # x_i accepted with probability min(1, p/q)
    last = race(correction(p, q, n, n == own), noise)
    return torch.cat([n[:, None], last[:, None], drafted], 1)


def draft_step(model, tokens: torch.Tensor, cache, noise: torch.Tensor | None, temperature: float, top_k: int,
               top_p: float):
    """One draft token per row over a compiled decoder's cache (what gets compiled): :func:`draft_pick` of the
    draft's next-token logits."""
    return draft_pick(compiled.forward_step(model, tokens, cache)[:, -1], noise, temperature, top_k, top_p)


def draft_steps(model, tokens: torch.Tensor, cache, noises: torch.Tensor | None, count: int, temperature: float,
                top_k: int, top_p: float):
    """``count`` draft tokens per row in one compiled graph (a fixed gamma): (B, 1) pending tokens (or (B, 2):
    the token before pending, not fed yet, and pending), (count, B, V) noise (None: greedy) -> (drafts (B, count),
    their distributions (B, count, V) or None): :func:`draft_step` ``count`` times, each feeding the token it
    drew; one call instead of ``count`` saves their per-call costs."""
    drafted, dists = [], []
    for i in range(count):
        token, q = draft_step(model, tokens, cache, None if noises is None else noises[i], temperature, top_k, top_p)
        drafted.append(token)
        dists.append(q)
        tokens = token[:, None]
    return torch.stack(drafted, 1), None if noises is None else torch.stack(dists, 1)


def verify_step(model, tokens: torch.Tensor, cache, drafted: torch.Tensor, q, u, noise, own: torch.Tensor,
                temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target's verify pass over [pending, drafts] and :func:`accept`, in one compiled graph."""
    return accept(compiled.forward_step(model, tokens, cache), drafted, q, u, noise, own, temperature, top_k, top_p)


def verify_coupled(model, tokens: torch.Tensor, cache, drafted: torch.Tensor, noise: torch.Tensor, own: torch.Tensor,
                   temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target's verify pass over [pending, drafts] and :func:`accept_coupled`, in one compiled graph."""
    logits = compiled.forward_step(model, tokens, cache)
    return accept_coupled(probabilities(logits, temperature, top_k, top_p), drafted, noise, own)


def kept_tokens(accepted: int, emitted: int, drafted: int) -> int:
    """Tokens a row's caches keep after its pending token: the accepted drafts, fewer where its output was cut at
    its limit (so a finished row's caches end where its output ends)."""
    return min(accepted, emitted - 1)


def _check(target, draft, gamma: int, adaptive_gamma: bool = False, max_gamma: int | None = None) -> int:
    """Checks the arguments; returns the most tokens a row may draft in one step."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if max_gamma is not None and not adaptive_gamma:
        raise ValueError("max_gamma caps an adaptive gamma: it goes with adaptive_gamma=True")
    cap = gamma if max_gamma is None else int(max_gamma)
    if cap < gamma:
        raise ValueError(f"max_gamma ({max_gamma}) must be >= gamma ({gamma}), the starting value")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"target and draft vocabularies differ ({target.vocab_size} vs {draft.vocab_size})")
    return cap


def next_gamma(gamma: int, drafted: int, accepted: int, cap: int) -> int:
    """A row's next draft length from its last step: one more after it accepted every draft (up to ``cap``),
    one fewer after a rejection (down to 1)."""
    return min(gamma + 1, cap) if accepted == drafted else max(1, gamma - 1)


@torch.no_grad()
def iter_speculative_rows(target, draft, prompts: Sequence[Sequence[int]] | torch.Tensor,
                          max_new_tokens: int | Sequence[int], *,
                          gamma: int = 5, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                          seed: int | Sequence[int | None] | None = None, stats: SpecStats | None = None,
                          row_stats: list[SpecStats] | None = None, batched: bool | None = None,
                          adaptive_gamma: bool = False, max_gamma: int | None = None, compile: str = "off",
                          coupled: bool = False, lengths: DraftLength | None = None):
    """Speculative decoding of a batch of prompts (any lengths). Yields, per step, one list per row of
    the tokens that row emitted (empty once a row has its ``max_new_tokens``, which may be given per row).

    All rows draft and verify together: one batched draft pass per drafted token, one batched target
    pass per step, each row at its own position (ragged caches). Acceptance is decided per row, and
    each row's caches are rewound by its own count, so rows advance by different amounts and never
    see each other's tokens. Row r draws from its own generator (seed + r): its tokens are those it
    would get decoded alone (``seed`` may also be one seed per row). ``stats`` counts batched passes;
    ``row_stats[r]`` row r's own steps and the passes it took part in.
    ``batched=False`` (or a backend without ragged caches) runs the rows one after another.
    ``adaptive_gamma``: each row's draft length follows its acceptance (:func:`next_gamma`), starting at
    ``gamma``, at most ``max_gamma`` (default ``gamma``); the stats' histograms then run to ``max_gamma``.
    ``compile``: ``"off"`` (eager passes over the models' own caches), ``"on"`` / ``"auto"``: the draft's
    one-token steps and the target's verify passes compiled over fixed-capacity caches with device-side lengths
    (:mod:`efftx.generation.compiled`; "auto" decodes eagerly, logging why, where either model or the machine
    cannot, "on" raises). The prompts are prefilled eagerly either way; the tokens are the same up to float
    rounding (exactly, in the tests' CPU fp32 runs).
    ``coupled``: :func:`accept_coupled` instead of the ratio test: a row's tokens are then those
    :func:`~efftx.generation.decode.generate` samples with the same seed and settings (its token at each position
    raced with that position's noise), whatever the draft and gamma; a row without a seed draws from a
    :class:`~efftx.generation.sampling.Stream` seeded from torch's global RNG.
    ``lengths`` (coupled, eager passes): each step's draft length by measured cost, a
    :class:`~efftx.generation.draft_length.DraftLength` (its costs and acceptance carried from call to call): from 0,
    a step of the target alone, to each row's own gamma, the length with the most expected tokens a second at the
    batch's rows, so that drafting at a batch size where it does not pay (a CPU's 8 rows) costs about nothing. A
    step that drafts nothing leaves the draft behind by the tokens it emits; the next step that drafts feeds them
    first, in its first draft pass (each row's missed tokens, then its pending one, right-padded to the longest). The
    tokens are base decoding's whatever the lengths (coupled acceptance).
    """
    cap = _check(target, draft, gamma, adaptive_gamma, max_gamma)
    if lengths is not None:
        if not coupled:
            raise ValueError("draft lengths by cost (lengths) would change a ratio-test row's tokens with the load: "
                             "they go with coupled=True")
        if lengths.cap < cap:
            raise ValueError(f"lengths chooses up to {lengths.cap} drafts, the rows draft up to {cap}")
    rows = as_rows(prompts)
    n_rows = len(rows)
    limits = [int(max_new_tokens)] * n_rows if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    if len(limits) != n_rows:
        raise ValueError(f"{len(limits)} max_new_tokens for {n_rows} prompts")
    longest = max(len(r) + m for r, m in zip(rows, limits))
    limit = min(target.max_seq_len, draft.max_seq_len)
    if longest + cap > limit:
        raise ValueError(f"prompt + max_new_tokens ({longest}) + {'max_gamma' if cap > gamma else 'gamma'} ({cap}) "
                         f"exceeds the models' max_seq_len={limit}")
    stats = stats if stats is not None else SpecStats(gamma=cap)
    row_stats = row_stats if row_stats is not None else [SpecStats(gamma=cap) for _ in rows]
    row_gamma = [gamma] * n_rows  # each row's draft length (fixed unless adaptive_gamma)
    device = next(target.parameters()).device
    gens = generators(seed, n_rows, device)
    if coupled:  # noise by position: every row needs a stream
        gens = [Stream.fresh() if g is None else g for g in gens]
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    greedy = is_greedy(temperature)
    if batched is None:
        batched = target.supports_ragged and draft.supports_ragged
    total = longest + cap + 1
    static = _static_pair(target, draft, compile, n_rows, longest + cap, batched)
    if static is not None and lengths is not None:
        for decoder in static:
            decoder.release()
        raise ValueError("draft lengths by cost (lengths) run eager passes: use compile='off'")
    try:
        t_rows, d_rows = Rows(target, n_rows, total, batched), Rows(draft, n_rows, total, batched)
        if max(len(r) for r in rows) > 1:  # caches hold every prompt token but the last: the first "pending"
            t_rows.prefill([r[:-1] for r in rows])
            d_rows.prefill([r[:-1] for r in rows])
            for s in [stats, *row_stats]:
                s.target_calls += 1
                s.draft_calls += 1
        if static is not None:  # the prefilled caches move into the fixed-capacity device caches
            for decoder, eager in zip(static, (t_rows, d_rows)):
                decoder.load(eager.caches[0], eager.lengths)
            t_rows, d_rows = static
        yield from _steps(t_rows, d_rows, rows, limits, row_gamma, cap, gens, sampling, greedy, adaptive_gamma,
                          stats, row_stats, device, static=static is not None, coupled=coupled, lengths=lengths)
    finally:
        for decoder in static or ():
            decoder.release()


def _static_pair(target, draft, compile: str, batch: int, needed: int, batched: bool):
    """(target, draft) :class:`~efftx.generation.compiled.StaticDecoder`s for ``compile`` "on"/"auto", or None
    (eager: ``compile="off"``, or "auto" where either model cannot; "on" raises then)."""
    mode = compiled.CompileOptions(compile).compile
    if mode == "off":
        return None
    if not batched:
        if mode == "on":
            raise compiled.CompileUnavailable("compile='on' decodes the rows batched: it does not go with "
                                              "batched=False")
        return None
    pair = []
    for model in (target, draft):
        decoder, _ = compiled.plan(model, mode, batch, needed)
        if decoder is None:  # "auto" and this model cannot (plan logged why): both decode eagerly
            for other in pair:
                other.release()
            return None
        pair.append(decoder)
    return tuple(pair)


def _steps(t_rows, d_rows, rows, limits, row_gamma, cap, gens, sampling, greedy, adaptive_gamma, stats, row_stats,
           device, static: bool, coupled: bool = False, lengths: DraftLength | None = None):
    """The decoding loop of :func:`iter_speculative_rows` over prefilled target/draft states (eager
    :class:`~efftx.generation.decode.Rows` or compiled :class:`~efftx.generation.compiled.StaticDecoder`).

    Per step: ``gamma`` batched draft passes (tokens drawn on the device), one batched target pass, then every
    row's acceptance, its last token (residual or bonus) and its cache rewinds from tensors; the host reads one
    (B, gamma + 2) tensor per step (accepted counts, last tokens, drafts) to yield the tokens and size the rewinds.
    ``static`` (compiled decoders): the verify pass always feeds ``cap + 1`` tokens (one compiled shape under an
    adaptive gamma; the padding sits after every row's real tokens, so causal attention keeps it out of their
    logits, and the rewind drops it).
    Eager states (whose caches' rows can be taken apart, :func:`~efftx.generation.decode.splittable`): a row that
    has all its tokens leaves the batch (its cache rows are dropped with
    :meth:`~efftx.generation.decode.Rows.select`), so the steps that wait for the batch's slowest row do not
    also pass the finished rows through both models; each row draws from its own generator, so the others' tokens
    do not change. Compiled states keep their fixed batch shape. ``coupled``: each row's noise is that of its
    positions, its stream moved on by the tokens it emits (:func:`accept_coupled`). ``lengths``: each step's draft
    length by cost (see :func:`iter_speculative_rows`); each row's tokens not fed to the draft yet (its *tail*) are
    then kept on the host."""
    n_rows = len(rows)
    live = list(range(n_rows))  # the rows in the batch, by their index in ``rows``
    # finished rows may leave: eager states whose caches' rows can be taken apart (or per-row caches)
    leave = not static and all(not s.batched or splittable(s.model) for s in (t_rows, d_rows))
    pending = host_values([r[-1] for r in rows], torch.long, device)
    produced = [0] * n_rows
    vocab = t_rows.model.vocab_size
    knobs = (sampling["temperature"], sampling["top_k"], sampling["top_p"])

    def draft_once(tokens, noise):
        """(B, T) tokens in, the draft's next (B,) tokens and (B, V) distributions (None when greedy) out."""
        if static:
            return d_rows.run(draft_step, tokens, noise, *knobs)
        return draft_pick(d_rows.forward(tokens)[:, -1], noise, *knobs)

    # The draft's first pass of a step feeds [prev, pending] after a step in which some row accepted every draft:
    # that row's last draft was drawn but never fed, and every other row, rewound one token further, feeds its
    # token before pending again (one batched shape; this replaces a separate draft pass for the missing token).
    catch_up, prev = False, None
    # with lengths: per row, the tokens the draft has not been fed (before pending), and pending, on the host
    tails: list[list[int]] = [[] for _ in range(n_rows)]
    pend_of = [r[-1] for r in rows]

    while True:
        if not any(n < m for n, m in zip(produced, limits)):
            return
        if leave and any(produced[r] >= limits[r] for r in live):  # finished rows leave the batch
            kept = [i for i, r in enumerate(live) if produced[r] < limits[r]]
            t_rows, d_rows = t_rows.select(kept), d_rows.select(kept)
            at = host_values(kept, torch.long, device)
            pending = pending[at]
            prev = prev[at] if catch_up else prev
            live = [live[i] for i in kept]
        # the rows of the batch, in its order: still decoding, drafts per step, generators
        active = [produced[r] < limits[r] for r in live]
        gammas = [row_gamma[r] for r in live]
        row_gens = [gens[r] for r in live]
        # this step drafts as many tokens as its longest-drafting row; a row verifies only its own
        gamma_step = max(g for g, a in zip(gammas, active) if a)
        own = [g if a else 0 for g, a in zip(gammas, active)]  # drafts each row verifies (0: finished)
        if lengths is not None:  # this step's length by cost (0: the target alone), at most each row's own
            started = time.perf_counter()
            cut = lengths.choose([g for g, a in zip(gammas, active) if a])
            own = [min(g, cut) for g in own]
            gamma_step = max(own)
        if lengths is not None and not gamma_step:  # the target alone: a base step
            pending, emitted = _target_alone(t_rows, pending, live, active, row_gens, greedy, knobs, tails, pend_of,
                                             produced, stats, row_stats)
            lengths.record(0, len(live), time.perf_counter() - started, [0] * sum(active), [0] * sum(active))
            yield emitted
            continue
        # every random number of the step, drawn first in each row's fixed order (the values do not depend on
        # the passes): one race per drafted token, the acceptance uniforms of its own drafts, the last token's race
        width = cap if static else gamma_step  # compiled: one verify shape for every gamma_step
        noises, u, last_noise = [None] * gamma_step, None, None
        joint = coupled and not greedy
        if joint:  # the noise of each row's next positions: (width + 1, B, V), position i's for draft i
            position = position_noise(row_gens, width + 1, vocab, device)
            noises = position.transpose(0, 1).contiguous()
        elif not greedy:
            noises, u, last_noise = step_noise(row_gens, own, width, vocab, device)
        first = torch.stack([prev, pending], 1) if catch_up else pending[:, None]
        if lengths is not None:
            drafted, q = draft_with_tails(d_rows, [tails[r] for r in live], [pend_of[r] for r in live], pending,
                                          gamma_step, lambda logits, i: draft_pick(logits, noises[i], *knobs))
        elif static and not adaptive_gamma:  # every step drafts gamma tokens: all of them in one graph
            drafted, q = d_rows.run(draft_steps, first, None if greedy else noises[:gamma_step],
                                    gamma_step, *knobs, positions=gamma_step + catch_up)
        else:
            tokens, q = [], []
            token = first
            for i in range(gamma_step):
                drawn, dist = draft_once(token, noises[i])
                token = drawn[:, None]
                tokens.append(drawn)
                q.append(dist)
            drafted = torch.stack(tokens, 1)  # (B, gamma_step)
            q = None if greedy else torch.stack(q, 1)  # (B, gamma_step, V)
        own_t = host_values(own, torch.long, device)  # mid-step: no wait for the draft passes queued before it
        if width > gamma_step:  # padding after every row's real drafts: causal attention keeps it out of their
            pad = width - gamma_step  # logits, `own` out of their acceptance, and the rewind drops it
            drafted = torch.cat([drafted, drafted.new_zeros(len(live), pad)], 1)
            if not greedy:
                q = torch.cat([q, q.new_ones(len(live), pad, vocab)], 1)
        fed = torch.cat([pending[:, None], drafted], 1)
        n_fed = fed.shape[1]
        if joint and static:
            packed = t_rows.run(verify_coupled, fed, drafted, position, own_t, *knobs)
        elif joint:
            packed = accept_coupled(probabilities(t_rows.forward(fed), *knobs), drafted, position, own_t)
        elif static:
            packed = t_rows.run(verify_step, fed, drafted, q, u, last_noise, own_t, *knobs)
        else:
            packed = accept(t_rows.forward(fed), drafted, q, u, last_noise, own_t, *knobs)
        # the one read back per step: accepted counts, last tokens and the drafts, (B, width + 2)
        host = packed.tolist()
        emitted, accepted, keep = [[] for _ in range(n_rows)], [-1] * n_rows, []
        for r, a, (n_r, last_r, *drafts) in zip(live, active, host):
            if a:
                out = (drafts[:n_r] + [last_r])[: limits[r] - produced[r]]
                # tokens the caches keep after pending; -1 below = undo the step (a finished row)
                keep.append(kept_tokens(n_r, len(out), row_gamma[r]))
                emitted[r], accepted[r] = out, n_r
            else:
                keep.append(-1)
        # The target cache got pending + n_fed - 1 tokens; a row keeps pending + its kept tokens.
        t_rows.rewind([n_fed - 1 - k for k in keep])
        if lengths is not None:  # (a step of length 0 ran as _target_alone) the draft saw [tail, pending] and
            # gamma_step - 1 drafts; a row keeps its tail, pending and its kept drafts, its last draft the next tail if
            # it kept every draft; a finished row drops all it was fed
            d_rows.rewind([len(tails[r]) + gamma_step if k < 0 else max(gamma_step - 1 - k, 0)
                           for r, k in zip(live, keep)])
            for r, k, (_, last_r, *drafts) in zip(live, keep, host):
                tails[r] = [drafts[-1]] if k == gamma_step else []
                pend_of[r] = last_r
            lengths.record(gamma_step, len(live), time.perf_counter() - started,
                           [o for o, a in zip(own, active) if a], [accepted[r] for r, a in zip(live, active) if a])
        # The draft saw [prev,] pending and gamma_step - 1 drafts; a row keeps [prev,] pending and its kept drafts,
        # all but the last of them when the next step catches up (a row that keeps every draft lacks the last one);
        # a finished row drops all it was fed (its cache may hold nothing else: a one-token prompt, no new tokens).
        fed_draft = gamma_step + catch_up
        catch_up = lengths is None and gamma_step in keep
        if lengths is None:
            d_rows.rewind([fed_draft if k < 0 else gamma_step - 1 - k + catch_up for k in keep])
        if catch_up:  # each row's token before its next pending: [pending, drafts][kept drafts]
            at = host_values([max(k, 0) for k in keep], torch.long, device)
            prev = torch.cat([pending[:, None], drafted], 1).gather(1, at[:, None])[:, 0]
        for s in [stats] + [row_stats[r] for r, a in zip(live, active) if a]:
            s.draft_calls += gamma_step
            s.target_calls += 1
        if joint:  # a row's stream moves on by its tokens: one draw each, as base decoding draws them
            for r, gen in zip(live, row_gens):
                gen.set_state(gen.get_state() + len(emitted[r]))
        for r, a, o in zip(live, active, own):
            if a:
                for s in (stats, row_stats[r]):
                    s.steps += 1
                    s.accepted.append(accepted[r])
                    s.drafted.append(o)
                produced[r] += len(emitted[r])
                if adaptive_gamma and o:  # a step that drafted nothing for the row says nothing of its acceptance
                    row_gamma[r] = next_gamma(row_gamma[r], o, accepted[r], cap)
        pending = packed[:, 1]  # a row still decoding ended its step on its last token; a finished row's is unused
        yield emitted


def _target_alone(t_rows, pending: torch.Tensor, live: list[int], active: list[bool], row_gens, greedy: bool, knobs,
                  tails: list[list[int]], pend_of: list[int], produced: list[int], stats: SpecStats,
                  row_stats: list[SpecStats]) -> tuple[torch.Tensor, list[list[int]]]:
    """A coupled step of draft length 0 as base decoding steps: the target's pass over pending and base decoding's
    pick (each row's race with its stream's next draw, counted; greedy: the argmax), none of the verify's work. Each
    active row's pending token joins its tail (the draft has not seen it) and its new token becomes pending (in
    ``pend_of``); a finished row still in the batch is rewound. -> (the new pending tokens (B,), each row's tokens
    by its index in ``produced``)."""
    logits = t_rows.forward(pending[:, None])[:, -1]
    picked = logits.argmax(-1) if greedy else draw(probabilities(logits, *knobs), row_gens)
    if not all(active):
        t_rows.rewind([0 if a else 1 for a in active])
    emitted: list[list[int]] = [[] for _ in produced]
    for r, a, token in zip(live, active, picked.tolist()):
        if a:
            emitted[r] = [token]
            tails[r].append(pend_of[r])
            pend_of[r] = token
            produced[r] += 1
            for s in (stats, row_stats[r]):
                s.steps += 1
                s.accepted.append(0)
                s.drafted.append(0)
    for s in [stats] + [row_stats[r] for r, a in zip(live, active) if a]:
        s.target_calls += 1
    return picked, emitted


def draft_with_tails(d_rows, tails: list[list[int]], pends: list[int], pending: torch.Tensor, gamma: int, pick
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A step's ``gamma`` (>= 1) eager draft passes where rows may lag (their ``tails``: tokens kept but not fed to the
    draft yet): the first pass feeds each row [tail, pending], right-padded to the longest (``pends``: pending on the
    host), its logits read at pending and the padding rewound (without tails, a pass over pending alone); each later
    pass feeds the draft drawn before. ``pick(logits, i)`` draws draft ``i`` from its (B, V) logits -> (tokens (B,),
    distributions (B, V) or None). -> (drafts (B, gamma), their distributions (B, gamma, V) or None)."""
    if any(tails):
        device = pending.device
        width = max(len(t) for t in tails) + 1
        first = host_values([t + [p] + [0] * (width - 1 - len(t)) for t, p in zip(tails, pends)], torch.long, device)
        at = host_values([len(t) for t in tails], torch.long, device)
        logits = d_rows.forward(first)[torch.arange(len(tails), device=device), at]
        d_rows.rewind([width - 1 - len(t) for t in tails])
    else:
        logits = d_rows.forward(pending[:, None])[:, -1]
    tokens, q = [], []
    for i in range(gamma):
        if i:
            logits = d_rows.forward(tokens[-1][:, None])[:, -1]
        drawn, dist = pick(logits, i)
        tokens.append(drawn)
        q.append(dist)
    return torch.stack(tokens, 1), None if q[0] is None else torch.stack(q, 1)


def iter_speculative(target, draft, prompt: list[int], max_new_tokens: int, *, stats: SpecStats | None = None,
                     **kwargs):
    """Yield the tokens of each speculative step (a list of 1..gamma+1) for one prompt, up to max_new_tokens."""
    if not prompt:
        raise ValueError("the prompt is empty")
    for step in iter_speculative_rows(target, draft, [prompt], max_new_tokens, stats=stats, **kwargs):
        yield step[0]


def speculative_generate(target, draft, prompts: Sequence[Sequence[int]] | torch.Tensor,
                         max_new_tokens: int | Sequence[int], *,
                         gamma: int = 5, seed: int | None = None, batched: bool | None = None,
                         adaptive_gamma: bool = False, max_gamma: int | None = None, compile: str = "off",
                         coupled: bool = False, lengths: DraftLength | None = None,
                         **sampling) -> tuple[list[list[int]], SpecStats]:
    """Generate ``max_new_tokens`` per prompt (prompts may differ in length). Returns tokens and stats.

    Row r uses seed ``seed + r``; see :func:`iter_speculative_rows` (``adaptive_gamma``: a draft length per row
    from its acceptance, off by default: a fixed ``gamma``; ``compile``: compiled draft and verify passes).
    """
    rows = as_rows(prompts)
    stats = SpecStats(gamma=max_gamma if adaptive_gamma and max_gamma is not None else gamma)
    outputs: list[list[int]] = [[] for _ in rows]
    for step in iter_speculative_rows(target, draft, rows, max_new_tokens, gamma=gamma, seed=seed, stats=stats,
                                      batched=batched, adaptive_gamma=adaptive_gamma, max_gamma=max_gamma,
                                      compile=compile, coupled=coupled, lengths=lengths, **sampling):
        for out, toks in zip(outputs, step):
            out.extend(toks)
    return outputs, stats
