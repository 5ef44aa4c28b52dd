"""BlockManager: the paged KV cache's block table, with reference counts and automatic prefix caching.

A full block is identified by a chained hash: hash(parent block's hash, its token ids), so equal hashes
mean equal prefixes. Blocks whose reference count drops to zero keep their hash and sit in an LRU free
list: a later request with the same prefix takes them back; a fresh allocation evicts the oldest.
A freed block without a hash (a partial last block, or any block with prefix caching off) holds nothing
to find again, so it goes to the front of the list and is handed out first: cached prefixes live
longer, and a CPU cache keeps reusing memory it has already touched (its pages were faulted in and
may still be in cache) instead of faulting in never-used pages (~1 us per 4 KiB page here).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from asyncengine.sequence import Sequence


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    # NOTE: a cryptographic hash, not hash(): a collision would silently serve another prompt's KV.
    return hashlib.blake2b(parent + array("i", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # chained hash -> block id
        # free blocks in eviction order (oldest first); values unused
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.prefix_hits = 0
        self.prefix_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> None:
        """Gives a waiting sequence the cached blocks of its longest cached prefix, as computed tokens.

        At least one token is always left to compute: the model must run on it to produce logits.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = b""
        hashes: list[bytes] = []
        for i in range(max_blocks):
            h = chain_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.cached.get(h)
            if block is None:
                break
            hashes.append(h)
            parent = h
        self.prefix_queries += seq.num_tokens
        if not hashes:
            return
        for h in hashes:
            block = self.cached[h]
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_ids.append(block)
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(hashes) * self.block_size
        self.prefix_hits += seq.num_computed_tokens

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_ids) <= len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows seq's block table to hold num_tokens tokens; False (and no change) if blocks run out."""
        needed = self.blocks_needed(num_tokens) - len(seq.block_ids)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            block, _ = self.free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:  # evict its cached prefix
                if self.cached.get(old) == block:
                    del self.cached[old]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            seq.block_ids.append(block)
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Makes seq's newly full, computed blocks findable by later requests."""
        self.register_full_blocks(seq, seq.num_computed_tokens)

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Makes the full blocks among seq's first num_tokens tokens findable by later requests.

        The scheduler calls this for tokens it has just scheduled, before they are computed: a request
        scheduled after them (in the same step or a later one) may share those blocks, because every
        step writes a layer's K/V before that layer's attention reads any, and steps run in order on
        every worker. So a burst of requests with a common prompt computes it once, not once each."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else b""
        for i in range(len(seq.block_hashes), num_full):
            h = chain_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = seq.block_ids[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h
            seq.block_hashes.append(h)
            parent = h

    def free_seq(self, seq: Sequence) -> None:
        # free in reverse so a sequence's tail blocks are evicted before its (more shareable) head
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:  # nothing to find again: reuse it first
                    self.free.move_to_end(block, last=False)
        seq.block_ids = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
