"""An independent, deliberately naive model of vLLM's block pool, used to cross-check the fast one.

Plain lists, O(n) operations, one token-level hash per block (tuples of the whole prefix), written from
vllm-facts §1/§9 without sharing code with kvscope.harness.cachemodel.
"""

from __future__ import annotations


class RefPool:
    def __init__(self, num_gpu_blocks: int | None, block_size: int, split_free: bool = True) -> None:
        self.B = block_size
        self.infinite = num_gpu_blocks is None
        self.queue: list[int] = [] if self.infinite else list(range(1, num_gpu_blocks))
        self.hash_of: dict[int, object] = {}  # block -> key
        self.usable = None if self.infinite else num_gpu_blocks - 1
        self.seen: set = set()
        self.split_free = split_free

    def _find(self, key):
        # oldest surviving copy = the block whose key was set first; keep insertion order via dict
        for b, k in self.hash_of.items():
            if k == key:
                return b
        return None

    def run(self, tokens_prompt: list, tokens_all: list, salt=None) -> int:
        """tokens_all = prompt + output tokens (the last one is never computed)."""
        B, P = self.B, len(tokens_prompt)
        O = max(len(tokens_all) - P, 1)
        keys = [(salt, tuple(tokens_all[: (i + 1) * B])) for i in range((P + O - 1) // B)]
        cap = (P - 1) // B
        if self.infinite:
            k = 0
            while k < cap and keys[k] in self.seen:
                k += 1
            self.seen.update(keys)
            return k * B
        total = -(-(P + O - 1) // B)
        if total > self.usable:
            return 0
        hit = []
        for i in range(cap):
            b = self._find(keys[i])
            if b is None:
                break
            hit.append(b)
        for b in hit:
            self.queue.remove(b)
        new = []
        for _ in range(total - len(hit)):
            b = self.queue.pop(0)
            self.hash_of.pop(b, None)
            new.append(b)
        blocks = hit + new
        for i in range(len(hit), len(keys)):
            self.hash_of[blocks[i]] = keys[i]
        for b in reversed(blocks):
            if self.split_free and b not in self.hash_of:
                self.queue.insert(0, b)
            else:
                self.queue.append(b)
        return len(hit) * B
