"""Self-speculation (LayerSkip / Kangaroo): the target's own first L layers plus an exit draft, the rest verify.

Where it runs. The early layers are the target's own weights, so drafting runs on the target's worker, in the
target's own paged KV cache, at the very scratch slots the verify pass will use (workers/input_batch.py): a round
of K drafts is K + 1 forwards of layers ``0..L-1`` over the sequence's in-flight tokens and then one depth of the
drafted tree at a time (the exit, workers/layer_skip/exit.py, reads layer L's hidden state of each node of the last
depth and proposes its children: the top tokens for greedy requests, else drawn per ``tree_sampling`` with each
child's law recorded; a chain is the tree of one child per node; the last forward only computes the deepest
drafts' early layers). A node's rows attend to the committed prefix and its own ancestors only, so every branch's
lower-layer KV is what the verify would write at that slot. Each row's layer-L hidden state is kept
in a pad on the worker (``SelfDrafter``), and its KV for layers < L is already in the cache.

Verification then starts those rows at layer L: the pad's hidden states go through layers ``L..N-1`` with the same
scratch layout, writing the upper layers' KV beside the reused lower ones (reuse, not recompute: same weights,
same inputs). Commit moves the in-flight tokens' and the accepted path's KV for every layer; the rejected rows'
scratch slots (lower and upper layers alike) are never committed and are overwritten next round: the paged cache's
ordinary roll-back. A pad is used only when its base length and tokens equal the verified rows exactly, else the
rows are verified from layer 0.

What crosses processes per round: the drafted tokens (ints) go back to the controller, which sends them to verify
as any tree; the laws q (the exit's softmax after the request's transforms, per drafted token) go into the
verifying rank's own law store, and hidden states and KV never leave the target. On a tensor-parallel target every
rank runs the draft passes (each holds its heads' KV); rank 0 draws and broadcasts each round's tokens to the
others inside the group (the ranks' logits are the same; an unseeded draw is not), as it broadcasts the accepted
paths after verification. On Ray the self-draft call goes to every target rank like a verify call.
"""
