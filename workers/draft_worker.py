"""The draft worker: keeps the draft model's own cache and proposes a candidate tree per request per round.

A round for one request: feed the tokens the draft has not seen (the pending token, plus accepted nodes
whose KV it never computed), then expand the tree one depth at a time. Depth d's nodes are forwarded (their KV
lands in the draft's scratch pad) to get q for depth d+1; the deepest level is never forwarded. Every node
records the law it was actually drawn from, which is what verification needs for the invariant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.input_batch import SeqForward
from workers.messages import DraftSeq, DraftStep
from workers.proposal import draw_children
from workers.sampling import logits_to_probs
from workers.verification import CandidateTree, pad_draft_probs
from workers.worker_base import WorkerBase, prefill_forward, sampling_batch


@dataclass
class _Growing:
    """One request's tree while it is being drafted."""

    seq: DraftSeq
    scratch_parents: list[int]  # parents of the draft's scratch nodes: unseen chain, then tree nodes
    tokens: list[int] = field(default_factory=list)  # tree nodes
    parents: list[int] = field(default_factory=list)  # tree parent indices (-1: root)
    laws: list[torch.Tensor] = field(default_factory=list)  # [V] per tree node (sampled requests only)
    frontier: list[int] = field(default_factory=list)  # tree nodes expanded next (-1: the root)

    def scratch_index(self, tree_node: int) -> int:
        return len(self.seq.token_ids) - 1 if tree_node < 0 else len(self.seq.token_ids) + tree_node


class DraftWorker(WorkerBase):
    @property
    def vocab_size(self) -> int:
        return self.config.target_vocab_size or self.model_config.vocab_size

    @torch.inference_mode()
    def step(self, msg: DraftStep) -> list[CandidateTree]:
        self.runner.commit(msg.commits)
        self.drop(msg.finished)
        states = [_Growing(s, list(range(-1, len(s.token_ids) - 1)), frontier=[-1]) for s in msg.seqs]
        pieces = [prefill_forward(p, want_logits=False) for p in msg.prefills]
        pieces += [SeqForward(block_table=s.block_table, base_len=s.base_len, parents=st.scratch_parents,
                              token_ids=s.token_ids, logit_nodes=[len(s.token_ids) - 1])
                   for s, st in zip(msg.seqs, states, strict=True)]
        logits = self.runner.forward(pieces)  # [num seqs, Vd]: prefills asked for none
        depth = max((len(s.branching) for s in msg.seqs), default=0)
        all_states = states
        for d in range(depth):
            self._expand(states, logits, d)
            live = [st for st in states if d + 1 < len(st.seq.branching)]
            if not live:
                break
            pieces = []
            for st in live:
                new = st.frontier
                start = len(st.scratch_parents)
                st.scratch_parents += [st.scratch_index(st.parents[t]) for t in new]
                pieces.append(SeqForward(block_table=st.seq.block_table, base_len=st.seq.base_len,
                                         parents=list(st.scratch_parents), token_ids=[st.tokens[t] for t in new],
                                         new_start=start, logit_nodes=list(range(start, start + len(new)))))
            logits = self.runner.forward(pieces)  # [sum of frontier sizes, Vd]
            states = live  # _expand reads the rows in (request, frontier node) order, as laid out above
        return [self._finish(st) for st in all_states]

    def _expand(self, states: list[_Growing], logits: torch.Tensor, d: int) -> None:
        """Draw depth-d children for every frontier node; rows of ``logits`` follow the frontiers in order."""
        counts = [len(st.frontier) for st in states]
        specs = [st.seq.sampling for st in states]
        probs = logits_to_probs(pad_draft_probs(logits, self.vocab_size),
                                sampling_batch(specs, counts, logits.device))  # [rows, V]
        row = 0
        for st in states:
            width = st.seq.branching[d]
            gen = self.generator(st.seq.seq_id, st.seq.sampling, self.config.draft_seed_salt)
            new_frontier: list[int] = []
            for parent in st.frontier:
                if st.seq.sampling.greedy:
                    # Greedy requests are verified by argmax matching, which needs no law: the draft's top
                    # tokens by raw logit are the best guesses of the target's argmax.
                    toks = logits[row].topk(min(width, logits.shape[1])).indices
                    laws = None
                else:
                    toks, laws = draw_children(probs[row], width, self.config.tree_sampling, gen)
                for i, tok in enumerate(toks.tolist()):
                    new_frontier.append(len(st.tokens))
                    st.tokens.append(tok)
                    st.parents.append(parent)
                    if laws is not None:
                        st.laws.append(laws[i])
                row += 1
            st.frontier = new_frontier

    def _finish(self, st: _Growing) -> CandidateTree:
        tokens = torch.tensor(st.tokens, dtype=torch.long)
        parents = torch.tensor(st.parents, dtype=torch.long)
        if st.laws:
            probs = torch.stack(st.laws)  # [N, V]
        else:
            probs = torch.empty(len(st.tokens), 0)  # greedy: laws are one-hot by construction, never read
        return CandidateTree(tokens=tokens, parents=parents, draft_probs=probs)
