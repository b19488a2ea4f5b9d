"""Per-layer kernels behind :mod:`cluster.experts.placement` (one layer at a time; not a public API).

Notation: ``w[E]`` one layer's expert loads, ``c[E]`` replica counts, ``ex[W, S]`` the expert in each slot of each
worker, ``row[W*S]`` the same flattened (slot ``s`` on worker ``s // S``). A replica of ``e`` carries ``w[e]/c[e]``.
"Duplicates" are two replicas of one expert on one worker; every kernel avoids creating them while it can.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-12


def water_fill(w: np.ndarray, n: int) -> np.ndarray:
    """Replica counts for ``n`` slots: one each, then every spare slot to the expert with the highest load per
    replica (lowest id on ties). This minimises the heaviest replica."""
    c = np.ones(len(w), dtype=np.int64)
    for _ in range(n - len(w)):
        c[int(np.argmax(w / c))] += 1
    return c


def round_robin(c: np.ndarray, workers: int, s: int) -> np.ndarray:
    """Replicas in expert order, each on the next worker (cyclically) with room that does not hold it yet; then
    :func:`dedup` for the rare duplicate the cursor leaves at the end."""
    ex = [[] for _ in range(workers)]
    order = [e for e in range(len(c))] + [e for e in range(len(c)) for _ in range(c[e] - 1)]
    cur = 0
    for e in order:
        room = [(cur + k) % workers for k in range(workers) if len(ex[(cur + k) % workers]) < s]
        v = next((u for u in room if e not in ex[u]), room[0])
        ex[v].append(e)
        cur = (v + 1) % workers
    return dedup(np.zeros(len(c)), np.array(ex, dtype=np.int64)).ravel()


def lpt(w: np.ndarray, c: np.ndarray, workers: int, s: int) -> np.ndarray:
    """Longest processing time first: replicas heaviest first (ties: lowest expert id) onto the least-loaded worker
    with a free slot (ties: lowest worker), preferring workers without that expert; then :func:`dedup`."""
    share = w / c
    order = sorted(range(len(c)), key=lambda e: (-share[e], e))
    loads = np.zeros(workers)
    held = np.zeros((workers, len(c)), dtype=np.int64)
    ex = [[] for _ in range(workers)]
    for e in order:
        for _ in range(c[e]):
            free = np.array([len(x) < s for x in ex])
            pick = free & (held[:, e] == 0)
            cand = np.flatnonzero(pick if pick.any() else free)
            v = int(cand[np.argmin(loads[cand])])
            ex[v].append(e)
            loads[v] += share[e]
            held[v, e] += 1
    return dedup(w, np.array(ex, dtype=np.int64)).ravel()


def _held(ex: np.ndarray, num_experts: int) -> np.ndarray:
    held = np.zeros((ex.shape[0], num_experts), dtype=np.int64)
    np.add.at(held, (np.repeat(np.arange(ex.shape[0]), ex.shape[1]), ex.ravel()), 1)
    return held


def _dup_delta(held: np.ndarray, m: int, a: int, v: int, b: int) -> int:
    """Change in the number of duplicates when worker ``m`` gives ``a`` to worker ``v`` for ``b``."""
    return (-int(held[m, a] >= 2) + int(held[m, b] >= 1) - int(held[v, b] >= 2) + int(held[v, a] >= 1))


def dedup(w: np.ndarray, ex: np.ndarray) -> np.ndarray:
    """Swap duplicates away while some swap lowers the number of duplicates (lowest resulting max of the two
    workers first). The count falls with every swap, so this terminates."""
    ex = ex.copy()
    c = np.bincount(ex.ravel(), minlength=len(w))
    share = w / c
    while True:
        held = _held(ex, len(w))
        loads = share[ex].sum(1)
        best = None
        for m, e in zip(*np.nonzero(held >= 2), strict=True):
            i = int(np.flatnonzero(ex[m] == e)[0])
            for v in range(ex.shape[0]):
                for j in range(ex.shape[1]):
                    b = ex[v, j]
                    if v != m and b != e and _dup_delta(held, m, e, v, b) < 0:
                        d = share[e] - share[b]
                        cost = max(loads[m] - d, loads[v] + d)
                        if best is None or cost < best[0]:
                            best = (cost, m, i, v, j)
        if best is None:
            return ex
        _, m, i, v, j = best
        ex[m, i], ex[v, j] = ex[v, j], ex[m, i]


def refine(w: np.ndarray, ex: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """Pairwise swaps off the most-loaded worker: each swap strictly lowers that worker and keeps the other below
    its old load (so the maximum never rises and the sum of squares falls), never adding duplicates."""
    ex = ex.copy()
    c = np.bincount(ex.ravel(), minlength=len(w))
    share = w / c
    for _ in range(max_iter):
        wt = share[ex]
        loads = wt.sum(1)
        m = int(np.argmax(loads))
        held = _held(ex, len(w))
        a, b = ex[m], ex  # [S], [W, S]
        d = wt[m][:, None, None] - wt[None]  # [S(i on m), W(v), S(j on v)]
        pair = np.maximum(loads[m] - d, loads[None, :, None] + d)
        # change in duplicates: a leaves m, b joins m, b leaves v, a joins v
        dup = (-(held[m, a] >= 2).astype(np.int64)[:, None, None] + (held[m, b] >= 1)[None]
               - (np.take_along_axis(held, b, axis=1) >= 2)[None] + (held[:, a].T >= 1)[:, :, None])
        ok = (d > _EPS) & (pair < loads[m] - _EPS) & (dup <= 0) & (a[:, None, None] != b[None])
        ok[:, m, :] = False
        if not ok.any():
            break
        i, v, j = np.unravel_index(int(np.argmin(np.where(ok, pair, np.inf))), ok.shape)
        ex[m, i], ex[v, j] = ex[v, j], ex[m, i]
    return ex


def max_load(w: np.ndarray, ex: np.ndarray) -> float:
    c = np.bincount(ex.ravel(), minlength=len(w))
    return float((w / c)[ex].sum(1).max())


def search(w: np.ndarray, workers: int, s: int, rounds: int = 3, receivers: int = 4) -> np.ndarray:
    """Duet's packing of one layer: greedy's (water-fill + LPT), refined by swaps; then moves of one replica from a
    donor expert to one of the ``receivers`` heaviest per replica, kept when the refined packing's maximum falls.
    The result's maximum is never above greedy's (greedy's own packing is the first candidate)."""
    c = water_fill(w, workers * s)
    greedy = lpt(w, c, workers, s).reshape(workers, s)
    best, best_max = greedy, max_load(w, greedy)
    cand = refine(w, greedy)
    if max_load(w, cand) < best_max - _EPS:
        best, best_max = cand, max_load(w, cand)
    bound = max(w.sum() / workers, float((w / c).max()))
    for _ in range(rounds):
        if best_max <= bound * (1 + 1e-9):
            break
        c = np.bincount(best.ravel(), minlength=len(w))
        improved = False
        for r in np.argsort(-(w / c), kind="stable")[:receivers]:
            for d in np.flatnonzero(c >= 2):
                if d == r:
                    continue
                c2 = c.copy()
                c2[d] -= 1
                c2[r] += 1
                if (w / c2).max() >= best_max - _EPS:
                    continue
                cand = refine(w, lpt(w, c2, workers, s).reshape(workers, s))
                cm = max_load(w, cand)
                if cm < best_max - _EPS:
                    best, best_max, improved = cand, cm, True
        if not improved:
            break
    return best.ravel()


def _violations(ex: np.ndarray, node_of: np.ndarray, num_experts: int) -> int:
    """Sum over experts of (nodes it could span) - (nodes it spans)."""
    nodes = int(node_of.max()) + 1
    on = np.zeros((nodes, num_experts), dtype=np.int64)
    np.add.at(on, (np.repeat(node_of, ex.shape[1]), ex.ravel()), 1)
    c = on.sum(0)
    return int((np.minimum(c, nodes) - (on > 0).sum(0)).sum())


def spread(w: np.ndarray, row: np.ndarray, workers: int, s: int, node_of: np.ndarray) -> np.ndarray:
    """Swaps that spread experts' replicas over more nodes without raising the layer's maximum worker load or adding
    duplicates; first improving swap with the lowest pair maximum, until none is left."""
    ex = row.reshape(workers, s).copy()
    share = w / np.bincount(ex.ravel(), minlength=len(w))
    while True:
        viol = _violations(ex, node_of, len(w))
        if viol == 0:
            return ex.ravel()
        loads = share[ex].sum(1)
        top = loads.max() + _EPS
        held = _held(ex, len(w))
        best = None
        for m in range(workers):
            for i in range(s):
                for v in range(workers):
                    if node_of[v] == node_of[m]:
                        continue
                    for j in range(s):
                        a, b = ex[m, i], ex[v, j]
                        if a == b or held[v, a] or held[m, b]:
                            continue
                        d = share[a] - share[b]
                        pair = max(loads[m] - d, loads[v] + d)
                        if pair > top or (best is not None and pair >= best[0]):
                            continue
                        ex[m, i], ex[v, j] = b, a
                        if _violations(ex, node_of, len(w)) < viol:
                            best = (pair, m, i, v, j)
                        ex[m, i], ex[v, j] = a, b
        if best is None:
            return ex.ravel()
        _, m, i, v, j = best
        ex[m, i], ex[v, j] = ex[v, j], ex[m, i]


def migrate(w: np.ndarray, row: np.ndarray, workers: int, s: int, max_moves: int, target: float) -> np.ndarray:
    """Apply the best single-slot change or two-slot swap (most reduction of the maximum per move, then of the sum
    of squares), within ``max_moves`` moves, until ``target`` balancedness or no improvement."""
    row = row.copy()
    n, num_e = workers * s, len(w)
    ws = np.arange(n) // s
    moves = 0
    while moves < max_moves:
        c = np.bincount(row, minlength=num_e)
        share = w / c
        loads = share[row].reshape(workers, s).sum(1)
        mx, sq = loads.max(), (loads ** 2).sum()
        if mx <= 0 or loads.mean() / mx >= target:
            break
        held = _held(row.reshape(workers, s), num_e)
        best = _best_change(w, row, c, held, loads, ws, mx, sq)
        if moves + 2 <= max_moves:
            sw = _best_swap(share, row, held, loads, ws, mx, sq)
            if sw is not None and (best is None or sw[:2] > best[:2]):
                best = sw
        if best is None:
            break
        for slot, e in best[2]:
            row[slot] = e
        moves += len(best[2])
    return row


def _pick(gain: np.ndarray, gsq: np.ndarray, ok: np.ndarray, cost: int):
    """Index of the best candidate as (gain per move, sq gain per move, flat index), or None."""
    if not ok.any():
        return None
    g = np.where(ok, gain, -np.inf)
    if g.max() > _EPS:
        k = int(np.argmax(np.where(g >= g.max() - _EPS, gsq, -np.inf)))
    else:
        q = np.where(ok & (gain >= -_EPS), gsq, -np.inf)
        if q.max() <= _EPS:
            return None
        k = int(np.argmax(q))
    return float(gain.flat[k]) / cost, float(gsq.flat[k]) / cost, k


def _best_change(w, row, c, held, loads, ws, mx, sq):
    workers, num_e = len(loads), len(w)
    a = row
    ca = c[a].astype(np.float64)
    onehot = np.eye(workers)[ws]  # [n, W]
    with np.errstate(divide="ignore", invalid="ignore"):
        da = (held[:, a].T - onehot) * (w[a] / (ca - 1))[:, None] - held[:, a].T * (w[a] / ca)[:, None]  # [n, W]
    db_all = held.T * (w / (c + 1) - w / c)[:, None]  # [E, W]
    new = loads[None, None] + da[:, None] + db_all[None] + onehot[:, None] * (w / (c + 1))[None, :, None]
    ok = (c[a] >= 2)[:, None] & (a[:, None] != np.arange(num_e)[None])
    ok &= (held[ws] == 0) | (c >= workers)[None]  # no duplicate while avoidable
    new = np.where(ok[..., None], new, np.inf)
    nmax, nsq = new.max(-1), (new ** 2).sum(-1)
    r = _pick(mx - nmax, sq - nsq, ok, 1)
    if r is None:
        return None
    slot, e = divmod(r[2], num_e)
    return r[0], r[1], [(slot, e)]


def _best_swap(share, row, held, loads, ws, mx, sq):
    n, workers = len(row), len(loads)
    a = row
    d = share[a][:, None] - share[a][None]  # slot s gives a, gets b = row[t]
    ok = (ws[:, None] != ws[None]) & (a[:, None] != a[None])
    ok &= (held[ws][:, a] == 0).T & (held[ws][:, a] == 0)  # b not on ws, a not on wt
    ok = np.triu(ok, 1)
    new = np.broadcast_to(loads, (n, n, workers)).copy()
    idx = np.arange(n)
    new[idx[:, None], idx[None], ws[:, None]] -= d
    new[idx[:, None], idx[None], ws[None]] += d
    nmax = new.max(-1)
    nsq = (new ** 2).sum(-1)
    r = _pick(mx - nmax, sq - nsq, ok, 2)
    if r is None:
        return None
    s1, s2 = divmod(r[2], n)
    return r[0], r[1], [(s1, int(row[s2])), (s2, int(row[s1]))]


def align_row(cand: np.ndarray, cur: np.ndarray, workers: int, s: int) -> np.ndarray:
    """``cand`` with workers matched greedily to current workers by shared experts, and each worker's experts put
    in the slots where the current worker already holds them."""
    num_e = int(max(cand.max(), cur.max())) + 1
    hc, ho = _held(cand.reshape(workers, s), num_e), _held(cur.reshape(workers, s), num_e)
    overlap = np.minimum(hc[:, None], ho[None]).sum(-1)  # [cand worker, current worker]
    match, used_c, used_o = {}, set(), set()
    for k in np.argsort(-overlap, axis=None, kind="stable"):
        i, j = divmod(int(k), workers)
        if i not in used_c and j not in used_o:
            match[j] = i
            used_c.add(i)
            used_o.add(j)
    out = np.empty(workers * s, dtype=np.int64)
    for j in range(workers):
        pool = list(cand[match[j] * s:(match[j] + 1) * s])
        old = cur[j * s:(j + 1) * s]
        slot = [None] * s
        for k, e in enumerate(old):
            if e in pool:
                pool.remove(e)
                slot[k] = e
        it = iter(pool)
        out[j * s:(j + 1) * s] = [e if e is not None else next(it) for e in slot]
    return out
