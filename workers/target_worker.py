"""The target worker: one forward over prefill chunks and every request's candidate tree, then verification.

For a request in a round the scratch pad holds its in-flight tokens (normally the one recovered/bonus token
from last round) as a chain, followed by the candidate tree. The logits at the last in-flight token give p for
the root's children; the logits at node i give p for node i's children (or the bonus at a leaf). After
verification the in-flight tokens and the accepted path are committed; the rest of the scratch is dropped.

The laws the candidates were drawn from come from the draft worker directly (``law_store``), keyed by the tree
id the controller passes along: only the rank that verifies ever holds them.
"""

from __future__ import annotations

import itertools
import time

import torch

from workers.eagle.features import FeatureSink, SeqFeatures, committed_rows
from workers.grammar_mask import apply_allowed
from workers.input_batch import SeqForward
from workers.law_channel import LawStore, LawsUnavailable
from workers.layer_skip.messages import SelfDraftOutput, SelfDraftStep
from workers.layer_skip.setup import build_self_drafter
from workers.logprobs import prefill_logit_nodes, prefill_logprobs, verify_logprobs
from workers.messages import (
    ONE_HOT_TREE,
    CommitSpec,
    PrefillSeq,
    TargetStep,
    TargetStepOutput,
    TokenLogprobs,
    VerifyResult,
    VerifySeq,
)
from workers.sampling import logits_to_probs, sample
from workers.streams import TARGET_SALT, stream
from workers.tree_topology import scratch_parents
from workers.verification import CandidateTree, verify_batch, verify_greedy
from workers.worker_base import WorkerBase, prefill_forward, sampling_batch


def one_hot_laws(tokens: list[int], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, V] float32: node i's law is all mass on its own token (a deterministic proposal's q)."""
    q = torch.zeros(len(tokens), vocab_size, dtype=torch.float32, device=device)
    if tokens:
        q[torch.arange(len(tokens), device=device), torch.tensor(tokens, dtype=torch.long, device=device)] = 1.0
    return q


def _verify_piece(s: VerifySeq) -> SeqForward:
    u = len(s.token_ids)
    parents = scratch_parents(u, s.tree_parents)
    return SeqForward(block_table=s.block_table, base_len=s.base_len, parents=parents,
                      token_ids=s.token_ids + s.tree_tokens, logit_nodes=list(range(u - 1, len(parents))))


def _commit(s: VerifySeq, accepted: list[int]) -> CommitSpec:
    """The in-flight tokens and the accepted path, from their scratch slots (the layout of ``_verify_piece``)."""
    u = len(s.token_ids)
    return CommitSpec(s.block_table, s.base_len, list(range(u)) + [u + j for j in accepted])


class TargetWorker(WorkerBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Filled by the draft (in-process) or by the law receiver thread (Ray).
        self.law_store = LawStore(timeout_s=self.config.step_timeout_s)
        # An EAGLE head drafting for this target: where the committed rows' hidden states go (rank 0 only), set
        # with ``feed_eagle`` (workers/eagle/features.py). None: nothing is captured.
        self.feature_sink: FeatureSink | None = None
        # Self-speculation (method layer_skip): drafts with the early layers, verifies from layer L. None: off.
        self.self_drafter = build_self_drafter(self)

    def feed_eagle(self, layers: tuple[int, ...], sink: FeatureSink | None) -> None:
        """Capture ``layers``' hidden states in every forward and hand the committed rows to ``sink``."""
        self.model.model.aux_layers = tuple(layers)
        self.feature_sink = sink

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.inference_mode()
    def step(self, msg: TargetStep | SelfDraftStep) -> TargetStepOutput | SelfDraftOutput:
        """Every tensor-parallel rank runs the forward; rank 0 samples and verifies, then tells the others
        which paths to commit (each rank holds its own heads' KV)."""
        if isinstance(msg, SelfDraftStep):  # method layer_skip's draft call, sent to every rank like a step
            return self.self_draft(msg)
        start = time.perf_counter()
        self.law_store.drop(msg.finished)
        sampled = [p for p in msg.prefills if p.sample is not None]
        # a sampled chunk's last row; every row when it asks for prompt logprobs (echo)
        pieces = [prefill_forward(p, prefill_logit_nodes(p)) for p in msg.prefills]
        num_pre = sum(len(piece.logit_nodes) for piece in pieces)
        pieces += [_verify_piece(s) for s in msg.seqs]
        if self.self_drafter is not None:  # self-drafted rounds start at layer L (workers/layer_skip/)
            logits = self.self_drafter.forward(pieces, [None] * len(msg.prefills) + [s.seq_id for s in msg.seqs])
        else:
            logits = self.runner.forward(pieces)  # [prefill rows + sum(N_i + 1), V], the same on every rank

        first_tokens: dict[int, int] = {}
        results: list[VerifyResult] = []
        laws_error = None
        first_lp: dict[int, TokenLogprobs] = {}
        prompt_lp: dict[int, TokenLogprobs] = {}
        if self.tp.is_first:
            ends = list(itertools.accumulate(len(piece.logit_nodes) for piece in pieces[: len(msg.prefills)]))
            last = [e - 1 for e, p in zip(ends, msg.prefills, strict=True) if p.sample is not None]
            last_rows = torch.tensor(last, dtype=torch.long, device=logits.device)  # each sampled chunk's last row
            first_tokens = self._sample_first(sampled, logits[: len(sampled)] if num_pre == len(sampled) else
                                              logits.index_select(0, last_rows))
            first_lp, prompt_lp = prefill_logprobs(msg.prefills, logits[:num_pre], first_tokens)
            try:
                results = self._verify(msg.seqs, logits[num_pre:])
            except LawsUnavailable as e:
                # Not raised past the broadcast: the other ranks wait in it, and a rank that skipped it would
                # leave the group's collectives out of step for every later call. No path is accepted; the
                # in-flight tokens' KV is committed as it is (real tokens, rewritten identically next time).
                laws_error = str(e)
                results = [VerifyResult([], [], 0, False) for _ in msg.seqs]
        if self.feature_sink is not None and self.tp.is_first and laws_error is None:
            self.feature_sink(self._features(msg, results), msg.finished)
        paths = self.tp.broadcast_int_lists([r.accepted_nodes for r in results] if self.tp.is_first else None,
                                            len(msg.seqs), self.device)
        self.runner.commit([_commit(s, path) for s, path in zip(msg.seqs, paths, strict=True)])
        if laws_error is not None:
            return TargetStepOutput({}, [], time.perf_counter() - start, laws_error)
        lp = first_lp | verify_logprobs(msg.seqs, logits[num_pre:], results) if self.tp.is_first else {}
        return TargetStepOutput(first_tokens, results, time.perf_counter() - start, logprobs=lp,
                                prompt_logprobs=prompt_lp)

    def self_draft(self, msg: SelfDraftStep) -> SelfDraftOutput:
        """Drafts with the target's own early layers (method layer_skip); the next ``step`` verifies from layer L."""
        if self.self_drafter is None:
            raise RuntimeError("self_draft on a target worker built without layer_skip_exit_layer")
        return self.self_drafter.draft(msg)

    def _features(self, msg: TargetStep, results: list[VerifyResult]) -> list[SeqFeatures]:
        """The captured hidden states of every row now committed: prompt chunks, in-flight tokens, accepted paths."""
        aux = self.model.model.aux_hidden  # [T, F], the forward's rows in piece order
        seqs = [(p.seq_id, p.base_len) for p in msg.prefills] + [(s.seq_id, s.base_len) for s in msg.seqs]
        rows = committed_rows([len(p.token_ids) for p in msg.prefills] +
                              [len(s.token_ids) + len(s.tree_tokens) for s in msg.seqs],
                              [0] * len(msg.prefills) + [len(s.token_ids) for s in msg.seqs],
                              [None] * len(msg.prefills) + [r.accepted_nodes for r in results])
        index = torch.tensor([i for r in rows for i in r], dtype=torch.long, device=aux.device)
        kept = aux.index_select(0, index).float().cpu().split([len(r) for r in rows])  # [n_i, F] each
        return [SeqFeatures(s, base, f) for (s, base), f in zip(seqs, kept, strict=True)]

    def _sample_first(self, sampled: list[PrefillSeq], logits: torch.Tensor) -> dict[int, int]:
        if not sampled:
            return {}
        specs = [p.sample for p in sampled]
        if any(p.allowed is not None for p in sampled):  # a grammar's mask for the first token
            logits = torch.cat([apply_allowed(logits[i: i + 1], p.allowed) if p.allowed is not None
                                else logits[i: i + 1] for i, p in enumerate(sampled)])  # [S, V]
        probs = logits_to_probs(logits, sampling_batch(specs, [1] * len(specs), logits.device))  # [S, V]
        # The first token is drawn after the whole prompt (streams keyed by position: workers/streams.py).
        gens = [stream(p.sample, TARGET_SALT, p.base_len + len(p.token_ids), self.device) for p in sampled]
        return dict(zip([p.seq_id for p in sampled], sample(probs, gens).tolist(), strict=True))

    def _verify(self, seqs: list[VerifySeq], logits: torch.Tensor) -> list[VerifyResult]:
        results: list[VerifyResult | None] = [None] * len(seqs)
        sampled: list[tuple[int, CandidateTree, torch.Tensor]] = []  # (index in seqs, tree, logits [N + 1, V])
        row = 0
        for i, s in enumerate(seqs):
            n = len(s.tree_tokens)
            rows = logits[row: row + n + 1]  # [N + 1, V]
            row += n + 1
            if s.allowed is not None:  # a grammar: p at each node is the target's masked given the node's path
                rows = apply_allowed(rows, s.allowed)
            if s.tree_id >= 0 and n:
                q = self.law_store.take(s.seq_id, s.tree_id, n, self.device)  # [N, V]
            elif s.tree_id == ONE_HOT_TREE and not s.sampling.greedy:
                q = one_hot_laws(s.tree_tokens, self.vocab_size, self.device)  # [N, V]
            else:
                q = torch.empty(n, 0 if s.sampling.greedy else self.vocab_size, device=self.device)  # [N, V]
            tree = CandidateTree(tokens=torch.tensor(s.tree_tokens, dtype=torch.long, device=self.device),
                                 parents=torch.tensor(s.tree_parents, dtype=torch.long, device=self.device),
                                 draft_probs=q)
            if s.sampling.greedy:
                results[i] = verify_greedy(tree, rows.argmax(dim=-1))
            else:
                sampled.append((i, tree, rows))
        if sampled:
            # One transform over every sampled row (row-local: each row gets the bits it would get alone), then
            # one verify_batch: same-shaped trees are verified together, each request drawing from its own stream.
            counts = [t.num_nodes + 1 for _, t, _ in sampled]
            specs = [seqs[i].sampling for i, _, _ in sampled]
            probs = logits_to_probs(torch.cat([r for _, _, r in sampled]),
                                    sampling_batch(specs, counts, logits.device))  # [sum(N_i + 1), V]
            gens = [stream(seqs[i].sampling, TARGET_SALT, seqs[i].base_len + len(seqs[i].token_ids), self.device)
                    for i, _, _ in sampled]
            verified = verify_batch([t for _, t, _ in sampled], list(probs.split(counts)), gens)
            for (i, _, _), res in zip(sampled, verified, strict=True):
                results[i] = res
        return results  # type: ignore[return-value]
