"""Compiled kernel of the suffix-decoding model (``speculative.simulate_suffix``): one request's decode steps in
one call, over suffix trees that are windows of fixed token arrays (``speculative``'s docstring says why).

Why compiled (numba, a dependency of vLLM's CPU wheel; ``@njit(cache=True)``: the first run after an
installation or a change here compiles, and later processes load the cached code): ``benchmarks/speculate_speed.py``
showed that numpy cannot reach the goal.  The same algorithm in numpy and Python spent its time in the
interpreter (514,658 decode steps on the 620 M-token agent preset), because a step is a few dozen small operations (a
chain of 2-4 nodes, one or two path walks of up to 24 tokens, a tally of a few continuations), each far
cheaper than one numpy call; they cannot be batched across steps either, since each step's context depends
on how many drafts the previous one accepted.  The timings, interpreted and compiled, are in
benchmarks/README.md (``speculate_speed.py``).

Layout (numba holds tuples of arrays and typed containers, not Python objects):

* a tree is the tuple ``(arr, order, starts, uni, ends, lengths, events, leaders, counts, kids, split, scratch,
  knobs, split_vals, split_starts, split_grouped)``: ``arr`` the fixed int64 token array (-1 separates
  sequences), ``order``/``starts`` its positions grouped by token (the unigram nodes), ``uni[token + 1]`` the
  unigram's node (-2 not made yet, -1 none);
* node ``i`` is the end positions of all occurrences of its string in ``arr`` (``ends[i]``, ascending, so a
  window ``[lo, hi)`` is two binary searches) and its length; its children one token to the left (a longer
  match) or to the right (a path step) are made on demand and kept in ``kids``, keyed ``(node, side, token)``
  (-1: no occurrence);
* a node with many occurrences groups them by the neighbouring token once per side (a counting sort, in
  ``scratch``, a zeroed count per token reset after each use), recorded in ``split`` (node x side -> index
  into ``split_*``); each child is then a slice;
* windows with few occurrences skip the nodes: the occurrences themselves are tallied and narrowed (the match
  lengths by comparing tokens leftwards);
* a node whose window from 0 holds many occurrences keeps a *continuation timeline* (after each continuation,
  in position order, the most frequent next token so far and its count), so the most frequent child in any
  window ``[0, hi)`` is one binary search; it is one pass, since the occurrences are in position order.

The thresholds (``knobs``) change the speed only; tests/offline/test_speculative_model.py forces each way
and checks every draft against a plain-trie transcription of Arctic's algorithm (float32 scores, ties).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types  # type: ignore[attr-defined]  # numba ships no type hints
from numba.typed import Dict, List


def new_tree(arr: np.ndarray, list_at_most: int, split_above: int, timeline_above: int) -> tuple:
    """The empty tree (no node made yet) over ``arr`` (int64; -1 separates sequences).  The knobs change the
    speed, never the result: a window of at most ``list_at_most`` (>= 1) occurrences is a small array whose
    continuations are tallied directly (one occurrence always is: its continuation is copied and scored as
    Arctic scores a single-occurrence path); a node with more than ``split_above`` occurrences groups them by
    the neighbouring token at once; a window from 0 with more than ``timeline_above`` occurrences uses the
    node's continuation timeline."""
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    shifted = arr + 1  # separators (-1) first
    top = int(shifted.max()) if arr.size else 0
    keys = shifted.astype(np.uint16) if top < (1 << 16) else shifted
    order = np.argsort(keys, kind="stable").astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(np.bincount(shifted, minlength=top + 1)))).astype(np.int64)
    uni = np.full(top + 1, -2, np.int64)
    ends = List.empty_list(types.int64[::1])
    lengths = List.empty_list(types.int64)
    events = List.empty_list(types.int64[::1])
    leaders = List.empty_list(types.int64[::1])
    counts = List.empty_list(types.int64[::1])
    kids = Dict.empty(key_type=types.int64, value_type=types.int64)
    split = List.empty_list(types.int64)
    scratch = np.zeros(top + 2, np.int64)
    knobs = np.array([max(1, list_at_most), split_above, timeline_above], np.int64)
    split_vals = List.empty_list(types.int64[::1])
    split_starts = List.empty_list(types.int64[::1])
    split_grouped = List.empty_list(types.int64[::1])
    return (arr, order, starts, uni, ends, lengths, events, leaders, counts, kids, split, scratch, knobs,
            split_vals, split_starts, split_grouped)


@njit(cache=True)
def _new_node(tree, ends, length):
    tree[4].append(ends)
    tree[5].append(length)
    tree[6].append(np.zeros(0, np.int64))
    tree[7].append(np.zeros(0, np.int64))
    tree[8].append(np.zeros(0, np.int64))
    tree[10].append(-1)
    tree[10].append(-1)
    return len(tree[4]) - 1


@njit(cache=True)
def _unigram(tree, token):
    uni = tree[3]
    if token < 0 or token + 1 >= uni.size:
        return -1
    node = uni[token + 1]
    if node == -2:
        starts = tree[2]
        a, b = starts[token + 1], starts[token + 2]
        node = _new_node(tree, tree[1][a:b].copy(), 1) if b > a else -1
        uni[token + 1] = node
    return node


@njit(cache=True)
def _key(node, left, token):
    return (node * 2 + (1 if left else 0)) * 4294967296 + (token + 1)


@njit(cache=True)
def _child(tree, node, token, left):
    """The node of ``token + string`` (``left``) or ``string + token``, -1 for none; made on first use.  A node
    with many occurrences groups them by that token once (a stable sort), and each child is then a slice."""
    kids = tree[9]
    key = _key(node, left, token)
    if key in kids:
        return kids[key]
    side = node * 2 + (1 if left else 0)
    sid = tree[10][side]
    arr = tree[0]
    size = arr.size
    ends = tree[4][node]
    length = tree[5][node]
    n = ends.size
    if sid < 0 and n > tree[12][1]:  # group every occurrence by the token at once, one stable sort
        keys = np.empty(n, np.int64)
        pos = np.empty(n, np.int64)
        for i in range(n):
            e = ends[i]
            if left:
                at = e - length
                keys[i] = arr[at] if at >= 0 else -1
                pos[i] = e
            else:
                at = e + 1
                keys[i] = arr[at] if at < size else -1
                pos[i] = at
        # a counting sort by token (stable: occurrences stay ascending within a token), in the zeroed scratch
        scratch = tree[11]
        distinct = np.empty(n, np.int64)
        ngroups = 0
        for i in range(n):
            k = keys[i] + 1
            if scratch[k] == 0:
                distinct[ngroups] = keys[i]
                ngroups += 1
            scratch[k] += 1
        vals = np.sort(distinct[:ngroups])
        starts = np.empty(ngroups + 1, np.int64)
        off = 0
        for g in range(ngroups):
            k = vals[g] + 1
            starts[g] = off
            off += scratch[k]
            scratch[k] = starts[g]
        starts[ngroups] = n
        grouped = np.empty(n, np.int64)
        for i in range(n):
            k = keys[i] + 1
            grouped[scratch[k]] = pos[i]
            scratch[k] += 1
        for g in range(ngroups):
            scratch[vals[g] + 1] = 0
        sid = len(tree[13])
        tree[13].append(vals)
        tree[14].append(starts)
        tree[15].append(grouped)
        tree[10][side] = sid
    if sid >= 0:
        vals = tree[13][sid]
        i = np.searchsorted(vals, token)
        if i < vals.size and vals[i] == token:
            starts = tree[14][sid]
            child = _new_node(tree, tree[15][sid][starts[i]:starts[i + 1]], length + 1)
        else:
            child = -1
        kids[key] = child
        return child
    cnt = 0
    sel = np.empty(n, np.int64)
    for i in range(n):
        e = ends[i]
        if left:
            at = e - length
            if at >= 0 and arr[at] == token:
                sel[cnt] = e
                cnt += 1
        else:
            at = e + 1
            if at < size and arr[at] == token:
                sel[cnt] = at
                cnt += 1
    child = _new_node(tree, sel[:cnt].copy(), length + 1) if cnt else -1
    kids[key] = child
    return child


@njit(cache=True)
def _timeline(tree, node):
    arr = tree[0]
    size = arr.size
    ends = tree[4][node]
    scratch = tree[11]
    ev = np.empty(ends.size, np.int64)
    ld = np.empty(ends.size, np.int64)
    ct = np.empty(ends.size, np.int64)
    k = 0
    best = 0
    lead = -1
    for e in ends:
        q = e + 1
        if q >= size:
            continue
        t = arr[q]
        if t < 0:
            continue
        c = scratch[t] + 1
        scratch[t] = c
        if c > best or (c == best and t < lead):
            best = c
            lead = t
        ev[k] = q
        ld[k] = lead
        ct[k] = best
        k += 1
    for e in ends:  # reset the counts touched
        q = e + 1
        if q < size and arr[q] >= 0:
            scratch[arr[q]] = 0
    tree[6][node] = ev[:k].copy()
    tree[7][node] = ld[:k].copy()
    tree[8][node] = ct[:k].copy()
    return k


@njit(cache=True)
def _leader(tree, node, lo, i0, i1, hi):
    """(token, count) of the most frequent continuation inside ``[.., hi)`` (smallest token of equal counts) of
    the node's occurrences ``ends[i0:i1]``; count 0 when none continues inside the window."""
    if lo == 0 and i1 - i0 > tree[12][2]:
        if tree[6][node].size == 0 and tree[4][node].size:
            _timeline(tree, node)
        ev = tree[6][node]
        if ev.size == 0:
            return -1, 0
        j = np.searchsorted(ev, hi)
        if j == 0:
            return -1, 0
        return tree[7][node][j - 1], tree[8][node][j - 1]
    return _tally_continuations(tree[0], tree[4][node][i0:i1], hi, tree[11])


@njit(cache=True)
def _tally_continuations(arr, ends, hi, scratch):
    """(token, count) of the most frequent token after the occurrences ending at ``ends`` inside ``[.., hi)``
    (smallest token of equal counts; -1, 0 when none continues), tallied in ``scratch`` and reset after."""
    best = 0
    lead = -1
    for e in ends:
        q = e + 1
        if q < hi:
            t = arr[q]
            if t >= 0:
                c = scratch[t] + 1
                scratch[t] = c
                if c > best or (c == best and t < lead):
                    best = c
                    lead = t
    for e in ends:
        q = e + 1
        if q < hi and arr[q] >= 0:
            scratch[arr[q]] = 0
    return lead, best


@njit(cache=True)
def _match_groups(tree, pattern, lo, hi, g_m, g_count, g_node, g_i0, g_i1, g_occ, g_len, g_nocc):
    """The occurrences in ``[lo, hi)`` of the pattern's suffix of each match length (speculative's
    ``_match_groups``): fills the group arrays (``g_m[g] = (m_lo, m_hi)``; the occurrences are
    ``ends[g_i0[g]:g_i1[g]]`` of node ``g_node[g]``, or, where that is -1, the few occurrences ``g_occ[i]``
    (``i < g_nocc[0]``) whose match length ``g_len[i]`` is at least ``g_i0[g]``) and returns the number of
    groups."""
    arr = tree[0]
    size = pattern.size
    top = size - 1
    ng = 0
    if top < 1:
        return 0
    node = _unigram(tree, pattern[size - 1])
    m = 1
    nocc = 0
    few = tree[12][0]
    occ = np.empty(few, np.int64)
    while node >= 0:
        ends = tree[4][node]
        i1 = np.searchsorted(ends, hi)
        i0 = np.searchsorted(ends, lo) if lo else 0
        count = i1 - i0
        if count <= few:
            for i in range(count):
                occ[i] = ends[i0 + i]
            nocc = count
            break
        if ng and g_count[ng - 1] == count:
            g_m[ng - 1, 1] = m
        else:
            g_m[ng, 0] = m
            g_m[ng, 1] = m
            g_count[ng] = count
            g_node[ng] = node
            g_i0[ng] = i0
            g_i1[ng] = i1
            ng += 1
        if m == top:
            return ng
        m += 1
        node = _child(tree, node, pattern[size - m], True)
    if nocc == 0:
        return ng
    for i in range(nocc):  # each occurrence's longest match, up to top
        e = occ[i]
        n = m
        while n < top and e - n >= 0 and arr[e - n] == pattern[size - 1 - n]:
            n += 1
        g_len[i] = n
        g_occ[i] = e
    g_nocc[0] = nocc
    left = nocc
    while left and m <= top:
        shortest = top + 1
        for i in range(nocc):
            if g_len[i] >= m and g_len[i] < shortest:
                shortest = g_len[i]
        if ng and g_count[ng - 1] == left:
            g_m[ng - 1, 1] = shortest
        else:
            g_m[ng, 0] = m
            g_m[ng, 1] = shortest
            g_count[ng] = left
            g_node[ng] = -1
            g_i0[ng] = m  # the group's occurrences: g_occ[i] with g_len[i] >= m
            ng += 1
        m = shortest + 1
        left = 0
        for i in range(nocc):
            if g_len[i] >= m:
                left += 1
    return ng


@njit(cache=True)
def _suffix_path(tree, node, i0, i1, occ_in, len_in, n_in, room, lo, hi, min_prob, path, scores):
    """speculative's ``_suffix_path``: writes the tokens to ``path`` and the scores to ``scores``; returns
    (path length, scores length, tail probability or -1.0 for no tail)."""
    arr = tree[0]
    few = tree[12][0]
    occ = np.empty(few, np.int64)
    scratch = tree[11]
    is_list = node < 0
    nocc = 0
    if is_list:
        for i in range(n_in):
            if len_in[i] >= i0:
                occ[nocc] = occ_in[i]
                nocc += 1
    prob = np.float32(1.0)
    score = np.float32(0.0)
    npath = 0
    scores[0] = score
    nsc = 1
    while npath < room:
        if not is_list and i1 - i0 <= few:
            ends = tree[4][node]
            nocc = i1 - i0
            for i in range(nocc):
                occ[i] = ends[i0 + i]
            is_list = True
        if is_list:
            if nocc == 1:
                e = occ[0]
                stop = min(hi, e + 1 + room - npath)
                if prob >= min_prob:
                    for q in range(e + 1, stop):
                        t = arr[q]
                        if t < 0:
                            break
                        path[npath] = t
                        npath += 1
                    return npath, nsc, prob
                break
            size = nocc
            val, count = _tally_continuations(arr, occ[:nocc], hi, scratch)
            if count == 0:
                break
        else:
            size = i1 - i0
            val, count = _leader(tree, node, lo, i0, i1, hi)
            if count == 0:
                break
        if count != size:  # a ratio of 1 leaves the probability as it is
            p = prob * (np.float32(count) / np.float32(size))
            if p < min_prob:
                break
            prob = p
        elif prob < min_prob:
            break
        path[npath] = val
        npath += 1
        score = score + prob
        scores[nsc] = score
        nsc += 1
        if is_list:
            k = 0
            for i in range(nocc):
                q = occ[i] + 1
                if q < hi and arr[q] == val:
                    occ[k] = q
                    k += 1
            nocc = k
        else:
            node = _child(tree, node, val, False)
            ends = tree[4][node]
            if lo:
                i0 = np.searchsorted(ends, lo)
                i1 = np.searchsorted(ends, hi)
            else:
                i0 = 0
                i1 = count
    return npath, nsc, np.float32(-1.0)


@njit(cache=True)
def _path_score(scores, nsc, tail_prob, n):
    k = nsc - 1
    if n <= k or tail_prob < 0:
        return scores[min(n, k)]
    return scores[k] + tail_prob * np.float32(n - k)


@njit(cache=True)
def _draft(tree, pattern, lo, hi, bounds, min_prob, floor, out):
    """speculative's ``_suffix_draft``: writes the best draft to ``out``; returns (its length, its score)."""
    g_m = np.empty((pattern.size + 1, 2), np.int64)
    g_count = np.empty(pattern.size + 1, np.int64)
    g_node = np.empty(pattern.size + 1, np.int64)
    g_i0 = np.empty(pattern.size + 1, np.int64)
    g_i1 = np.empty(pattern.size + 1, np.int64)
    g_occ = np.empty(tree[12][0], np.int64)
    g_len = np.empty(tree[12][0], np.int64)
    g_nocc = np.zeros(1, np.int64)
    ng = _match_groups(tree, pattern, lo, hi, g_m, g_count, g_node, g_i0, g_i1, g_occ, g_len, g_nocc)
    room_max = 0
    for b in bounds:
        room_max = max(room_max, b)
    path = np.empty(max(room_max, 1), np.int64)
    scores = np.empty(max(room_max, 1) + 1, np.float32)
    nbest = 0
    best_score = floor
    found = False
    for g in range(ng - 1, -1, -1):
        m_lo, m_hi = g_m[g, 0], g_m[g, 1]
        if g_count[g] == 1 and g_node[g] < 0:
            last = -1
            for i in range(g_nocc[0]):
                if g_len[i] >= g_i0[g]:
                    last = g_occ[i]
            if last == hi - 1:
                continue  # only the pattern itself, at the very end: nothing follows it
        walked = False
        npath = 0
        nsc = 0
        tail = np.float32(-1.0)
        for m in range(m_hi, m_lo - 1, -1):
            bound = bounds[m]
            if (bound <= best_score) if not found else (bound < best_score):
                continue
            if not walked:
                room = bounds[m_lo]
                for q in range(m_lo, m + 1):
                    room = max(room, bounds[q])
                npath, nsc, tail = _suffix_path(tree, g_node[g], g_i0[g], g_i1[g], g_occ, g_len, g_nocc[0], room,
                                                lo, hi, min_prob, path, scores)
                walked = True
            n = min(bound, npath)
            score = _path_score(scores, nsc, tail, n)
            if score > best_score or (found and score == best_score):
                for q in range(n):
                    out[q] = path[q]
                nbest = n
                best_score = score
                found = True
    return nbest, best_score


@njit(cache=True)
def suffix_request(local, glob, has_glob, g_lo, g_start, plen, n_out, depth, num_spec, max_model_len, adaptive,
                   min_prob):
    """One request's decode steps (speculative's ``_suffix_request``): the request's tree is ``local`` (its
    chain's stream) in ``[0, T)``, the global tree ``glob`` in ``[g_lo, g_start + p)``.  ``max_model_len`` -1
    for none; ``adaptive[m]``: the adaptive draft length of match ``m``.  Returns (drafted, accepted, contexts,
    open_ended)."""
    stream = local[0]
    cap = max(n_out, 1)
    drafted = np.empty(cap, np.int32)
    accepted = np.empty(cap, np.int32)
    contexts = np.empty(cap, np.int64)
    bounds = np.empty(depth + 1, np.int64)
    d_loc = np.empty(depth + 1, np.int64)
    d_glob = np.empty(depth + 1, np.int64)
    floor0 = np.float32(0.0)
    open_ended = False
    nsteps = 0
    p = 1
    while p < n_out:
        T = plen + p
        nd = 0
        d = d_loc
        max_spec = num_spec
        if max_model_len >= 0:
            max_spec = min(max_spec, max_model_len - T - 1)
        if max_model_len < 0 or T < max_model_len:
            for m in range(depth + 1):
                bounds[m] = min(max_spec, adaptive[m], depth - m)
            pattern = stream[max(0, T - depth):T]
            nd, s_local = _draft(local, pattern, 0, T, bounds, min_prob, floor0, d_loc)
            if has_glob:
                # the request's own tree wins ties, so the global one only matters above its score
                ng, s_glob = _draft(glob, pattern, g_lo, g_start + p, bounds, min_prob, s_local, d_glob)
                if s_glob > s_local:
                    nd = ng
                    d = d_glob
        a = 0
        known = n_out - p
        if nd:
            mm = min(nd, known)
            while a < mm and d[a] == stream[T + a]:
                a += 1
            if a == known and nd > known:
                open_ended = True
        drafted[nsteps] = nd
        accepted[nsteps] = a
        contexts[nsteps] = T
        nsteps += 1
        p += a + 1
    return drafted[:nsteps].copy(), accepted[:nsteps].copy(), contexts[:nsteps].copy(), open_ended


def warm() -> None:
    """Compile every kernel into numba's on-disk cache (``make install`` calls it: ``python -m
    kvscope.harness.cachemodel.suffix_kernel``), so the first ``kvscope speculate`` does not pay the ≈ 25 s of
    CPU compilation. The argument types equal ``speculative.simulate_suffix``'s, so its calls load this code."""
    stream = np.array([5, 6, 7, 5, 6, 7, 5, 6, 8, 5, 6, 7], np.int64)
    tree = new_tree(stream, 1, 2, 2)
    glob = new_tree(np.concatenate([np.full(1, -1, np.int64), stream[6:]]), 1, 2, 2)
    depth = 4
    adaptive = np.array([m + 1 for m in range(depth + 1)], np.int64)
    suffix_request(tree, glob, True, 0, 1, 6, 6, depth, 3, -1, adaptive, np.float32(0.1))


if __name__ == "__main__":
    warm()
