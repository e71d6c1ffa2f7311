"""tune's time budget (``tune.max_minutes``): how much of it the closing validation KL takes, and
how the rest is shared among the blocks, as steps at the pace the block before ran them.

Example:
    >>> step_seconds(240.0, 24, 4.0)   # a block's seconds for its steps
    6.0
"""

from __future__ import annotations

import time

KL_SHARE = 0.5  # of tune.max_minutes, at most, for the closing validation KL: the rest trains


def kl_tokens(tokens: int, step: int, seconds: float, budget: float) -> int:
    """Validation tokens the closing KL reads: all ``tokens`` when their ``seconds`` fit
    :data:`KL_SHARE` of the ``budget``, else the whole slices (of ``step`` tokens) that do, one at
    least. At 27B's width on 2 cores the KL over all of them took 6.5 of tune.max_minutes=8, and
    the blocks' warm-up step ran the budget over; fewer tokens read a gain less surely, so a
    tight budget falls back to the input more often, never to a worse model."""
    slices = -(-tokens // step)
    if seconds <= KL_SHARE * budget:
        return tokens
    return min(tokens, step * max(1, int(slices * KL_SHARE * budget / seconds)))


def step_seconds(left: float, blocks: int, outside: float) -> float:
    """A block's seconds for its steps: its share of the ``left`` seconds over the ``blocks`` still
    to tune, less what a block costs besides its steps (``outside``: the last one's reference and
    input passes and validation checks), so the budget holds to the end instead of running over by
    that much a block."""
    return max(0.0, left / blocks - outside)


def blocks_to_train(left: float, blocks: int, outside: float, carry: float, pace: float) -> int:
    """How many of the ``blocks`` still to tune the ``left`` seconds can train, a step each at least
    (``pace``) besides their passes and checks (``outside``), the rest carried through untrained
    (``carry`` seconds each): the most that fit, so the time is shared as evenly as it holds.
    0 when not one does."""
    for m in range(blocks, 0, -1):
        if step_seconds(left - (blocks - m) * carry, m, outside) >= pace:
            return m
    return 0


def seconds_until(end: float, outside: float | None, trained: int, carried: float, passes: float) -> float:
    """A trained block's seconds for its steps: its share of the time to ``end`` (clock time) over
    the ``trained`` blocks, less what the ``carried`` blocks after them take (``carried`` blocks'
    worth of passes) and a block's passes and checks (the last block's ``outside``; before a
    block has run, what this one's ``passes`` before its steps took)."""
    o = outside or passes
    return step_seconds(end - time.monotonic() - carried * o, trained, o)


def carried_share(train: int, val: int) -> float:
    """A carried block's time in a trained one's passes and checks: the input, tuned and reference
    paths' passes over the ``val`` windows, of two passes over every window and four checks."""
    return 3 * val / (2 * train + 4 * val)
