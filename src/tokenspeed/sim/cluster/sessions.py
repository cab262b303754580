"""Live conversations: turn a workload `Session` into scheduler requests with cache keys.

Each conversation keeps the real cache's `KeyChain` of its history, so a turn appends only its
new tokens and its output (never re-hashing the history) and its request carries the page keys
of prompt and output. Tokens without a trace block id (outputs, un-hashed trace tails) get fresh
negative ids from the simulation's counter: they are unique to the conversation.

First turns of agentic sessions repeat long shared prefixes (system prompt, repository context);
`PrefixChains` remembers the chain at block boundaries that more than one session has reached,
so each shared prefix is hashed once per simulation instead of once per session.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from tokenspeed.cache import KeyChain
from tokenspeed.sched import Request
from tokenspeed.workload import Session, Turn

_STRIDE = 8  # remember chains every this many blocks


class PrefixChains:
    """Key chains of block-id prefixes seen in more than one first turn, by a running hash."""

    def __init__(self, page_size: int, block_size: int) -> None:
        self.page_size = page_size
        self.block_size = block_size
        self._seen: set[int] = set()
        self._chains: dict[int, KeyChain] = {}

    def start(self, blocks: Sequence[int]) -> tuple[KeyChain, int]:
        """A chain holding the longest remembered prefix of `blocks` (whole blocks only), and
        how many blocks it covers; remembers the boundaries this prefix shares with others."""
        best, best_at = None, 0
        h = 0
        marks = []
        for i, block in enumerate(blocks, start=1):
            h = hash((h, block))
            if i % _STRIDE:
                continue
            chain = self._chains.get(h)
            if chain is not None:
                best, best_at = chain, i
            elif h in self._seen:
                marks.append((i, h))  # second session to get here: remember the chain
            else:
                self._seen.add(h)
        chain = best.fork() if best is not None else KeyChain(self.page_size)
        done = best_at
        for i, h in marks:
            if i > best_at:
                chain.append_blocks(blocks[done:i], (i - done) * self.block_size, self.block_size)
                done = i
                self._chains[h] = chain.fork()
        return chain, done


class Conversation:
    __slots__ = ("chain", "index", "parent", "session", "subagents_left")

    def __init__(self, session: Session, parent: Conversation | None = None):
        self.session = session
        self.chain: KeyChain | None = None  # made with the first request
        self.index = 0  # the turn to issue next
        self.parent = parent
        self.subagents_left = 0

    @property
    def turn(self) -> Turn:
        return self.session.turns[self.index]

    def next_request(self, rid: int, prefixes: PrefixChains, fresh_ids: itertools.count) -> Request:
        """The request of the current turn: history + new tokens, asking for the turn's output."""
        turn = self.turn
        size = prefixes.block_size
        blocks = list(turn.blocks)
        blocks.extend(
            -next(fresh_ids) for _ in range(math.ceil(turn.new_tokens / size) - len(blocks))
        )
        if self.chain is None:
            # Only full blocks can come from the memo; the prompt's tail block may be partial.
            full = turn.new_tokens // size
            self.chain, done = prefixes.start(blocks[:full])
        else:
            done = 0
        chain = self.chain
        chain.append_blocks(blocks[done:], turn.new_tokens - done * size, size)
        prompt = chain.num_tokens
        out_blocks = [-next(fresh_ids) for _ in range(math.ceil(turn.output_tokens / size))]
        chain.append_blocks(out_blocks, turn.output_tokens, size)
        return Request(
            rid, prompt, turn.output_tokens, keys=chain.keys[:], session=self.session.sid
        )
