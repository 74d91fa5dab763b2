"""Statistical tests of the invariant: speculative decoding emits exactly the target's distribution.

Target and draft "models" are fixed random next-token tables over a tiny vocabulary that depend on the last two
tokens. Many independent generations run in lockstep rounds through the real draft-side (`draw_children_batch`)
and verification (`verify_tree_batch`) code, with the sampling transforms applied to both tables by
`logits_to_probs`. The empirical law of the first three emitted tokens is compared with the exact target law
(by enumeration) with a chi-square test. The same harness run on deliberately wrong rules must fail: that is
what shows the test has the power to catch a silent distribution error.

Thresholds. Seeds are fixed, so every test is deterministic; the thresholds say how surprising the fixed
outcome would be. A correct rule must give p > 1e-3: under the null hypothesis the p-value is uniform, so with
the ~10 lossless configurations below the chance that a correct implementation trips one for an unlucky
seed is under 1%. A wrong rule must give p < 1e-6 (or emit a token outside the target's support): at these
sample sizes the deviations of the controls are tens of standard errors, so this margin costs no power.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from scipy.stats import chisquare

from tests.conftest import marked_slow
from workers import verification
from workers.proposal import ProposalMode
from workers.proposal import draw_children_batch as draw
from workers.sampling import SamplingBatch, logits_to_probs
from workers.verification import CandidateTree, verify_greedy, verify_tree, verify_tree_batch

V = 5  # vocabulary
BOS = V  # context padding id
L = 3  # emitted tokens compared per generation: V**L = 125 cells
SAMPLES = 30_000
IID, WOR, DET = ProposalMode.IID, ProposalMode.WITHOUT_REPLACEMENT, ProposalMode.DETERMINISTIC

# A tree shape is a list of expansions (parent node, number of children, how they are drawn), parents first;
# children get consecutive node ids in the order drawn.
Shape = list[tuple[int, int, ProposalMode]]
CHAINS: list[Shape] = [[(i - 1, 1, IID) for i in range(g)] for g in (1, 2, 4)]
IID_TREE: Shape = [(-1, 3, IID), (0, 2, IID), (1, 1, IID), (3, 1, IID)]
WOR_TREE: Shape = [(-1, 3, WOR), (0, 2, WOR), (2, 2, WOR)]
DET_TREE: Shape = [(-1, 2, DET), (0, 2, DET), (1, 1, DET)]
MIXED_TREE: Shape = [(-1, 2, WOR), (0, 2, IID), (1, 1, DET), (2, 2, DET), (5, 1, WOR)]


@dataclass
class Params:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0


@dataclass
class Config:
    shapes: list[Shape]  # each round picks one at random (all generations share it that round)
    target: Params = field(default_factory=Params)
    draft: Params | None = None  # None: same as the target
    draft_vocab: int = V  # < V: the draft knows fewer tokens; its q is padded with pad_draft_probs
    told_draft: Params | None = None  # control: verification is told q under these params instead
    best_branch_only: bool = False  # control: keep only the child the target likes most
    seed: int = 0


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logit tables [V + 1, V + 1, V] indexed by the last two tokens; the draft is a noisy copy."""
    gen = torch.Generator().manual_seed(1000 + seed)
    target = torch.randn(V + 1, V + 1, V, generator=gen) * 1.5
    return target, target + torch.randn(V + 1, V + 1, V, generator=gen)


def _transform(logits: torch.Tensor, prm: Params, vocab: int = V) -> torch.Tensor:
    flat = logits[..., :vocab].reshape(-1, vocab)
    n = flat.shape[0]
    batch = SamplingBatch.from_lists([prm.temperature] * n, [prm.top_k] * n, [prm.top_p] * n, [prm.min_p] * n)
    probs = verification.pad_draft_probs(logits_to_probs(flat, batch), V)
    return probs.reshape(V + 1, V + 1, V)


def _round(cfg: Config, shape: Shape, ctx: torch.Tensor, P, Q, Q_told, gen) -> torch.Tensor:
    """One speculative round for every generation: ctx [S, 2] -> emitted tokens [S, depth + 1] (-1 padded)."""
    s = ctx.shape[0]
    n = sum(k for _, k, _ in shape)
    tokens = torch.full((s, n), -1, dtype=torch.long)
    laws = torch.zeros(s, n, V)
    node_ctx: list[torch.Tensor] = []
    parents: list[int] = []
    for par, k, mode in shape:
        c = ctx if par < 0 else node_ctx[par]  # [S, 2]
        q = Q[c[:, 0], c[:, 1]]  # [S, V]
        tok, law = draw(q, k, mode, torch.rand(s, k, generator=gen))
        if Q_told is not None:  # the wrong-q control uses i.i.d. shapes only, whose laws are q itself
            law = Q_told[c[:, 0], c[:, 1]].unsqueeze(1).expand(s, k, V)
        if par >= 0:
            tok = torch.where(tokens[:, par : par + 1] >= 0, tok, -1)
        first = len(parents)
        tokens[:, first : first + k], laws[:, first : first + k] = tok, law
        node_ctx += [torch.stack([c[:, 1], tok[:, j].clamp(min=0)], dim=1) for j in range(k)]
        parents += [par] * k
    target = torch.stack([P[ctx[:, 0], ctx[:, 1]]] + [P[c[:, 0], c[:, 1]] for c in node_ctx], dim=1)
    if cfg.best_branch_only:  # control: at every node, keep only the child with the largest target prob
        for par in set(parents):
            kids = [i for i, p in enumerate(parents) if p == par]
            px = target[:, par + 1].gather(1, tokens[:, kids].clamp(min=0))  # [S, k]
            best = torch.tensor(kids)[px.argmax(dim=1)]  # [S]
            for i in kids:
                tokens[:, i] = torch.where(best == i, tokens[:, i], -1)
    out = verify_tree_batch(parents, tokens, laws, target, torch.rand(s, n + 1, generator=gen))
    emitted = torch.cat([out.path_tokens, torch.full((s, 1), -1)], dim=1)
    return emitted.scatter(1, out.num_accepted.unsqueeze(1), out.final_token.unsqueeze(1))


def simulate(cfg: Config, samples: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (counts [V**L] of the first L emitted tokens, exact target law [V**L])."""
    torch.manual_seed(cfg.seed)  # only for anything that falls back to the default RNG
    gen = torch.Generator().manual_seed(cfg.seed)
    pick = random.Random(cfg.seed)
    t_logits, d_logits = _tables(cfg.seed)
    P = _transform(t_logits, cfg.target)
    Q = _transform(d_logits, cfg.draft or cfg.target, cfg.draft_vocab)
    Q_told = None if cfg.told_draft is None else _transform(d_logits, cfg.told_draft, cfg.draft_vocab)
    ctx = torch.full((samples, 2), BOS, dtype=torch.long)
    out = torch.full((samples, L), -1, dtype=torch.long)
    count = torch.zeros(samples, dtype=torch.long)
    rows = torch.arange(samples)
    while bool((count < L).any()):
        emitted = _round(cfg, pick.choice(cfg.shapes), ctx, P, Q, Q_told, gen)
        for j in range(emitted.shape[1]):
            tok = emitted[:, j]
            write = (tok >= 0) & (count < L)
            out[rows[write], count[write]] = tok[write]
            ctx = torch.where(write.unsqueeze(1), torch.stack([ctx[:, 1], tok], dim=1), ctx)
            count += write.long()
    index = (out * torch.tensor([V * V, V, 1])).sum(dim=1)
    P64 = P.double()
    exact = P64[BOS, BOS][:, None, None] * P64[BOS, :V][:, :, None] * P64[:V, :V]  # [V, V, V]
    return torch.bincount(index, minlength=V**L), exact.flatten()


def chi_square_p(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """p-value of counts against exact; 0 if any token lies outside the target's support."""
    n = int(counts.sum())
    if bool((counts[exact == 0] > 0).any()):
        return 0.0
    expected = exact * n
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if float(exp[-1]) < 5:  # the pooled cell itself too small: fold it into the largest cell
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[exp.argmax()] += counts[~big].sum()
        exp[exp.argmax()] += expected[~big].sum()
    exp = exp * (obs.sum() / exp.sum())  # remove float drift so scipy's sum check passes
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


LOSSLESS = {
    "chains_T1": Config(CHAINS, seed=1),
    "chains_T0.6_topk3": Config(CHAINS, Params(0.6, top_k=3), seed=2),
    "iid_tree_T1.3_topp0.8": Config([IID_TREE], Params(1.3, top_p=0.8), seed=3),
    "wor_tree_T0.8": Config([WOR_TREE], Params(0.8), seed=4),
    "wor_tree_topk3_minp0.1": Config([WOR_TREE], Params(1.0, top_k=3, min_p=0.1), seed=5),
    "det_tree_T1_minp0.15": Config([DET_TREE], Params(1.0, min_p=0.15), seed=6),
    "mixed_all_filters": Config([MIXED_TREE, *CHAINS], Params(0.9, top_k=4, top_p=0.9, min_p=0.05), seed=7),
    "draft_params_differ": Config([MIXED_TREE, IID_TREE], Params(0.8, top_k=3), draft=Params(1.4), seed=8),
    "draft_vocab_smaller": Config([WOR_TREE, CHAINS[2]], Params(1.1, top_p=0.95), draft_vocab=V - 2, seed=9),
}


@pytest.mark.parametrize("name", list(LOSSLESS))
def test_emits_the_target_distribution(name: str) -> None:
    counts, exact = simulate(LOSSLESS[name])
    p = chi_square_p(counts, exact)
    assert p > 1e-3, f"{name}: chi-square p = {p:.2e}, the emitted law is not the target's"


def _resample_from_p(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return r


WRONG = {
    # On rejection, sample from p instead of norm(max(0, p - q)).
    "resample_from_p": (Config(CHAINS, seed=11), _resample_from_p),
    "resample_from_p_tree": (Config([IID_TREE], Params(0.8), seed=12), _resample_from_p),
    # Take the branch the target likes most among the drawn children, then verify it as if drawn from q.
    "most_probable_branch": (Config([IID_TREE], Params(1.0), best_branch_only=True, seed=13), None),
    # Greedy branch choice at temperature > 0: verify against the target's argmax.
    "greedy_at_T1": (Config([IID_TREE], Params(1.0), seed=14), "greedy"),
    # The draft samples from q at T=1, verification is told q at T=0.7.
    "q_off_by_temperature": (Config(CHAINS, told_draft=Params(0.7), seed=15), None),
}


@pytest.mark.parametrize("name", marked_slow(WRONG, {"most_probable_branch", "greedy_at_T1", "resample_from_p"}))
def test_wrong_rules_are_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, patch = WRONG[name]
    if callable(patch):
        monkeypatch.setattr(verification, "residual_distribution", patch)
    if patch == "greedy":  # verification sees a one-hot p; the exact law stays the sampled target's
        real = verification.verify_tree_batch

        def greedy(parents, tokens, draft_probs, target_probs, uniforms):
            one_hot = torch.nn.functional.one_hot(target_probs.argmax(dim=-1), V).float()
            return real(parents, tokens, draft_probs, one_hot, uniforms)

        monkeypatch.setitem(globals(), "verify_tree_batch", greedy)
    counts, exact = simulate(cfg)
    p = chi_square_p(counts, exact)
    assert p < 1e-6, f"{name}: a wrong rule passed (chi-square p = {p:.2e}); the test has no power here"


@pytest.mark.parametrize(("alpha", "p", "q"), [
    (0.8, (0.5, 0.3, 0.2), (0.6, 0.1, 0.3)),
    (0.5, (0.5, 0.5, 0.0), (0.0, 0.5, 0.5)),
])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_mean_emitted_tokens_per_round(alpha: float, p, q, gamma: int) -> None:
    """Context-free p, q with per-position acceptance sum(min(p, q)) = alpha: E[N] = (1 - a^(g+1)) / (1 - a)."""
    assert abs(sum(min(a, b) for a, b in zip(p, q, strict=True)) - alpha) < 1e-12
    n = 20_000
    gen = torch.Generator().manual_seed(gamma)
    pt, qt = torch.tensor(p), torch.tensor(q)
    tokens, laws = draw(qt.expand(n * gamma, 3), 1, IID, torch.rand(n * gamma, 1, generator=gen))
    out = verify_tree_batch(list(range(-1, gamma - 1)), tokens.reshape(n, gamma), laws.reshape(n, gamma, 3),
                            pt.expand(n, gamma + 1, 3), torch.rand(n, gamma + 1, generator=gen))
    emitted = (out.num_accepted + 1).double()
    expect = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    # 5 standard errors of the mean: a false alarm is a 1-in-1.7-million event.
    tol = 5 * float(emitted.std()) / n**0.5
    assert abs(float(emitted.mean()) - expect) < tol, (float(emitted.mean()), expect, tol)
    # Each extra accepted position costs one more factor alpha: P(accepted >= j) = alpha^j.
    for j in range(1, gamma + 1):
        assert abs(float((out.num_accepted >= j).double().mean()) - alpha**j) < 0.015


def test_greedy_speculation_equals_greedy_decoding() -> None:
    """Target at T=0 with a deterministic draft tree: verify_greedy and verify_tree both give plain greedy."""
    t_logits, d_logits = _tables(20)
    P = _transform(t_logits, Params(0.0))  # one-hot rows
    Q = _transform(d_logits, Params(1.0))
    rng = random.Random(20)
    for prompt in range(30):
        start = (rng.randrange(V + 1), rng.randrange(V))
        plain, ctx = [], start
        for _ in range(12):
            plain.append(int(P[ctx].argmax()))
            ctx = (ctx[1], plain[-1])
        for use_greedy in (True, False):
            got, ctx = [], start
            while len(got) < 12:
                shape = rng.choice([DET_TREE, [(i - 1, 1, DET) for i in range(4)], [(-1, 3, DET), (1, 2, DET)]])
                toks, parents, laws, nctx = [], [], [], []
                for par, k, mode in shape:
                    c = ctx if par < 0 else nctx[par]
                    kid_toks, kid_laws = draw(Q[c].unsqueeze(0), k, mode)
                    for tok, law in zip(kid_toks[0].tolist(), kid_laws[0], strict=True):
                        toks.append(tok), parents.append(par), laws.append(law), nctx.append((c[1], tok))
                tree = CandidateTree(torch.tensor(toks), torch.tensor(parents), torch.stack(laws))
                rows = torch.stack([P[ctx]] + [P[c] for c in nctx])  # [N + 1, V]
                res = verify_greedy(tree, rows.argmax(dim=-1)) if use_greedy else verify_tree(tree, rows, None)
                got += res.tokens
                for tok in res.tokens:
                    ctx = (ctx[1], tok)
            assert got[:12] == plain, (prompt, use_greedy)
