"""Brute-force float64 references: the papers' formulas as double loops over pairs."""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import rankdata


def log1p_sum(terms):
    return math.log1p(sum(math.exp(t) for t in terms)) if terms else 0.0


def rank_margin(cos, scores, margin, tau):
    r = rankdata(scores, method="min")
    n = len(cos)
    return log1p_sum([tau * (cos[i] - cos[j]) for i in range(n) for j in range(n) if r[j] - r[i] > margin])


def cosent(cos, scores, tau):
    n = len(cos)
    return log1p_sum([tau * (cos[i] - cos[j]) for i in range(n) for j in range(n) if scores[j] > scores[i]])


def gated_angle(cos, labels, scores, tau):
    theta = [math.acos(max(-1.0, min(1.0, c))) for c in cos]
    n = len(cos)
    return log1p_sum(
        [tau * (theta[j] - theta[i]) for i in range(n) for j in range(n) if labels[i] > labels[j] and scores[i] < scores[j]]
    )


def cross_entropy_rows(rows, targets):
    total = 0.0
    for row, t in zip(rows, targets):
        finite = [v for v in row if v != -math.inf]
        m = max(finite)
        total += m + math.log(sum(math.exp(v - m) for v in finite)) - row[t]
    return total / len(rows)


def cosine(u, v):
    return float(np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)))


def hince(a, p, n, tau1, tau2):
    rows = []
    for i in range(len(a)):
        row = [cosine(a[i], p[j]) / tau1 for j in range(len(p))]
        if n is not None:
            row += [cosine(a[i], n[j]) / tau2 for j in range(len(n))]
        rows.append(row)
    return cross_entropy_rows(rows, list(range(len(a))))


def listmle(pred, target):
    losses = []
    for p, t in zip(pred, target):
        order = sorted(range(len(t)), key=lambda k: (-t[k], k))
        loss = 0.0
        for pos in range(len(order)):
            rest = [p[k] for k in order[pos:]]
            m = max(rest)
            loss += m + math.log(sum(math.exp(v - m) for v in rest)) - p[order[pos]]
        losses.append(loss)
    return sum(losses) / len(losses)


def refine(phi, omega):
    n = len(phi)
    a = np.zeros((n, n))
    for i in range(n):
        suffix = sorted(phi[i][i:], reverse=True)
        for k in range(i, n):
            a[i, k] = suffix[k - i] - phi[i][k]
    for i in range(n):
        for k in range(i + 1, n):
            a[k, i] = a[i, k]
    out = np.array(phi, dtype=float).copy()
    for i in range(n):
        for k in range(n):
            out[i, k] += math.copysign(math.log1p(omega * abs(a[i, k])), a[i, k]) if a[i, k] != 0 else 0.0
    return out


def relational(head, tail, rel, table, neg, tau, head_ids=None, tail_ids=None, neg_ids=None):
    """With ids: tail j (j != i) is no negative of row i when it shares i's head or tail text; hard negative j is
    none when its text is tail i."""
    rows = []
    for i in range(len(head)):
        q = head[i] + table[rel[i]]
        row = []
        for j in range(len(tail)):
            false = head_ids is not None and j != i and (head_ids[j] == head_ids[i] or tail_ids[j] == tail_ids[i])
            row.append(-math.inf if false else cosine(q, tail[j]) / tau)
        if neg is not None:
            for j in range(len(neg)):
                false = neg_ids is not None and neg_ids[j] == tail_ids[i]
                row.append(-math.inf if false else cosine(q, neg[j]) / tau)
        rows.append(row)
    return cross_entropy_rows(rows, list(range(len(head))))


def angle_ibn(e1, e2, positive, ids1, ids2, tau):
    rows, targets = [], []
    for i in range(len(e1)):
        if not positive[i]:
            continue
        row = []
        for j in range(len(e2)):
            duplicate = j != i and (ids2[j] == ids2[i] or ids2[j] == ids1[i] or (ids1[j] == ids1[i] and positive[j]))
            row.append(-math.inf if duplicate else tau * cosine(e1[i], e2[j]))
        rows.append(row)
        targets.append(i)
    return cross_entropy_rows(rows, targets)
