"""Verify trees: a chain of drafts plus leaves, alternatives to single draft slots (engine/layout.py runs them).

Greedy and coupled slots pass iff the draft is the token plain decoding emits there, so when the chain fails at slot
d (plain decoding emits t instead of draft d) a leaf at depth d whose token is t was the right draft: its row is the
row plain decoding computes next (bitwise, with the batch-invariant engine), and its token there is one more token
of plain decoding's output. A step's output is still plain decoding's; leaves only let a step emit one token more
where the chain's first miss was among the drafter's next guesses. A leaf costs one row, not its path.
Rejection sampling accepts by q and p, not by equality: its requests get no leaves.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .accept import Mode
from .propose import Proposal


# A leaf pays at batch 1 when it is kept on more than ~5% of steps: on a 2-core Zen 4 a SmolLM2 verify row costs
# ~0.7 ms of a ~20 ms step and a kept leaf is one more token of ~1.4 a step. Measured on chat (greedy, shipped block
# drafter, gamma 4): depth-1 alternatives with draft probability 0.1-0.2 were kept on 13% of steps, 0.2-0.3 on 28%,
# below 0.1 on 4%; deeper ones rarely (README, "Verify trees").
MIN_VALUE = 0.1
TREE_ROWS = 0          # the services' and `specdec generate`'s default budget of leaf rows a step: off (README)
ALTS = 3               # alternatives a step asks the drafter for per slot when it may verify leaves


def leaf_candidates(props: Sequence[Proposal], vlen: Sequence[int], modes: Sequence[Mode],
                    prob: Callable[[float], float] = lambda c: c) -> list[tuple[float, int, int, int]]:
    """(value, request, depth, token) for every alternative a step could verify, best first: only verified slots
    (d < verify_len) of greedy and coupled requests whose proposal has alternatives. Value: the chance the chain
    reaches depth d (prob of its drafts' confidences before d) times the alternative's draft probability."""
    cands = []
    for i, (p, v, m) in enumerate(zip(props, vlen, modes)):
        if m is Mode.REJECTION or not p.alts:
            continue
        reach = 1.0
        for d in range(1, min(v, len(p.alts) + 1)):
            cands += [(reach * pr, i, d, x) for x, pr in p.alts[d - 1] if x != p.tokens[d - 1]]
            reach *= prob(p.confidence[d - 1])
    return sorted(cands, key=lambda c: (-c[0], c[1], c[2], c[3]))


def as_leaves(chosen: Sequence[tuple[float, int, int, int]], n: int) -> list[list[tuple[int, int]]]:
    out: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for _, i, d, x in chosen:
        out[i].append((d, x))
    return out


def plan_leaves(props: Sequence[Proposal], vlen: Sequence[int], modes: Sequence[Mode], budget: int,
                min_value: float = MIN_VALUE) -> list[list[tuple[int, int]]]:
    """Per request, the (depth, token) leaves to verify: the likeliest candidates worth at least `min_value`, at most
    `budget` rows in all (a planner with a cost table decides by cost instead: CostPlanner.leaves)."""
    cands = [c for c in leaf_candidates(props, vlen, modes) if c[0] >= min_value]
    return as_leaves(cands[:max(0, budget)], len(props))


def kept_leaf(accepted: int, tokens: Sequence[int], drafts: Sequence[int], leaves: Sequence[tuple[int, int]]
              ) -> int | None:
    """The index of the leaf that stands where the chain failed, if any: the chain accepted `accepted` of its
    verified `drafts` and then emitted tokens[accepted]; a leaf at depth accepted + 1 with that token was right."""
    if accepted >= len(drafts):          # no draft failed: the last token is the bonus row's
        return None
    t = tokens[accepted]
    return next((k for k, (d, x) in enumerate(leaves) if d == accepted + 1 and x == t), None)
