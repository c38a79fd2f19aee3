"""Toy-attention checks from the seed documents: cached decoding equals recomputation, work counts,
and how an edited token invalidates later positions' K."""

from __future__ import annotations

import numpy as np


def token_passes(prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """Token positions pushed through the model to generate ``new_tokens`` (without, with a KV cache).

    Without a cache step ``i`` reprocesses the whole context ``prompt_len + i``; with one, the prompt is
    processed once and each later step processes one token.
    """
    without = sum(prompt_len + i for i in range(new_tokens))
    with_cache = prompt_len + new_tokens - 1 if new_tokens else 0
    return without, with_cache


def attention_score_work(n: int) -> tuple[float, int]:
    """Query-key scores to generate ``n`` tokens: ~n^3/6 without a cache, n(n+1)/2 with one."""
    return n ** 3 / 6, n * (n + 1) // 2


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def cached_decoding_check(n: int = 6, d_model: int = 8, d_k: int = 4, seed: int = 0) -> dict:
    """Causal attention computed at once vs token by token with a KV cache."""
    rng = np.random.default_rng(seed)
    Wq, Wk, Wv = [rng.standard_normal((d_model, d_k)) for _ in range(3)]
    X = rng.standard_normal((n, d_model))
    Q, K, V = X @ Wq, X @ Wk, X @ Wv
    S = Q @ K.T / np.sqrt(d_k)
    S = np.where(np.triu(np.ones((n, n), bool), 1), -np.inf, S)
    ref = _softmax(S) @ V
    K_cache, V_cache, outs, projections = np.zeros((0, d_k)), np.zeros((0, d_k)), [], 0
    for t in range(n):
        x = X[t:t + 1]
        q, k, v = x @ Wq, x @ Wk, x @ Wv
        projections += 3
        K_cache, V_cache = np.vstack([K_cache, k]), np.vstack([V_cache, v])
        outs.append(_softmax(q @ K_cache.T / np.sqrt(d_k)) @ V_cache)
    return {"equal": bool(np.allclose(np.vstack(outs), ref)), "projections_cached": projections,
            "projections_uncached": sum(3 * m for m in range(1, n + 1))}


def edit_invalidation(n: int = 6, d: int = 8, n_layers: int = 2, edit_pos: int = 2, seed: int = 0) -> list[list[int]]:
    """Positions whose K changes in each layer after editing the input vector at ``edit_pos``."""
    rng = np.random.default_rng(seed)
    Wq = [rng.standard_normal((d, d)) / 3 for _ in range(n_layers)]
    Wk = [rng.standard_normal((d, d)) / 3 for _ in range(n_layers)]
    Wv = [rng.standard_normal((d, d)) / 3 for _ in range(n_layers)]

    def forward(X: np.ndarray) -> list[np.ndarray]:
        Ks = []
        for l in range(n_layers):
            Q, K, V = X @ Wq[l], X @ Wk[l], X @ Wv[l]
            Ks.append(K)
            S = Q @ K.T / np.sqrt(d)
            S[np.triu_indices(n, 1)] = -np.inf
            P = np.exp(S - S.max(1, keepdims=True))
            P /= P.sum(1, keepdims=True)
            X = X + P @ V
        return Ks

    X = rng.standard_normal((n, d))
    X2 = X.copy()
    X2[edit_pos] += 1.0
    old, new = forward(X), forward(X2)
    return [[i for i in range(n) if np.abs(old[l][i] - new[l][i]).max() > 1e-12] for l in range(n_layers)]


