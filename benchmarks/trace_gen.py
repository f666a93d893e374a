"""Seeded generators of KV-cache request traces (Mooncake format: ``hash_ids`` per request).

    .venv/bin/python benchmarks/trace_gen.py NAME [--seed S] [--out FILE.jsonl]

Each generator builds requests from *contents* (system prompts, tool manifests, documents,
conversation turns, tool outputs, one-shot text) and chains them into prefix block ids the way
engines hash blocks: a block's id is determined by its parent's id and its own content, so two
requests share their first k ids exactly when they share the first k blocks of their prompt.

The family (``FAMILY``) varies what the policy sweep must be robust to: Zipf skew of shared
prefixes, agent loops with long or short tool outputs, RAG documents shared across sessions,
scans of one-shot prompts, diurnal mixes whose proportions drift, session lengths and gaps.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

__all__ = ["FAMILY", "generate", "Chainer"]


class Chainer:
    """Prefix block ids: ``ids(contents)`` -> one id per content, each keyed by its parent."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Hashable], int] = {}

    def ids(self, contents: list[Hashable]) -> list[int]:
        out = []
        parent = -1
        table = self._ids
        for c in contents:
            k = (parent, c)
            i = table.get(k)
            if i is None:
                i = table[k] = len(table)
            out.append(i)
            parent = i
        return out


@dataclass(frozen=True)
class Mix:
    """Parameters of one workload (fractions are of new sessions)."""

    chat: float = 1.0
    agent: float = 0.0
    rag: float = 0.0
    scan: float = 0.0
    prompts: int = 20  # distinct system prompts
    prompt_blocks: tuple[int, int] = (2, 8)
    zipf: float = 1.0  # skew of system prompt / document / manifest popularity
    docs: int = 200
    doc_blocks: tuple[int, int] = (4, 24)
    manifests: int = 10
    manifest_blocks: tuple[int, int] = (4, 12)
    turn_blocks: tuple[int, int] = (1, 3)
    tool_blocks: tuple[int, int] = (1, 3)  # tool output per agent step
    turns: float = 4.0  # mean turns (steps) per session, geometric
    active: int = 64  # sessions in flight (gap between turns of one session ~ active requests)
    diurnal: bool = False  # the mix drifts: chat-heavy -> agent/RAG-heavy -> chat-heavy


def _zipf_pick(rng: np.random.Generator, n: int, a: float) -> int:
    w = 1.0 / np.arange(1, n + 1) ** a
    return int(rng.choice(n, p=w / w.sum()))


def generate(m: Mix, requests: int, seed: int) -> list[list[int]]:
    """``requests`` requests of workload ``m`` (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    ch = Chainer()
    uniq = iter(range(1 << 62))
    plen = [int(rng.integers(*m.prompt_blocks, endpoint=True)) for _ in range(m.prompts)]
    dlen = [int(rng.integers(*m.doc_blocks, endpoint=True)) for _ in range(m.docs)]
    mlen = [int(rng.integers(*m.manifest_blocks, endpoint=True)) for _ in range(m.manifests)]
    pw = 1.0 / np.arange(1, m.prompts + 1) ** m.zipf
    pw /= pw.sum()
    dw = 1.0 / np.arange(1, m.docs + 1) ** m.zipf
    dw /= dw.sum()
    mw = 1.0 / np.arange(1, m.manifests + 1) ** m.zipf
    mw /= mw.sum()

    def new_session(t: float) -> dict:
        kinds = ["chat", "agent", "rag", "scan"]
        w = np.array([m.chat, m.agent, m.rag, m.scan], float)
        if m.diurnal:  # one day over the trace: agents and RAG peak mid-trace
            day = np.sin(np.pi * t) ** 2
            w = w * np.array([1.0 - 0.8 * day, 0.2 + day, 0.2 + day, 1.0])
        kind = kinds[int(rng.choice(4, p=w / w.sum()))]
        p = int(rng.choice(m.prompts, p=pw))
        ctx: list[Hashable] = [("sys", p, j) for j in range(plen[p])]
        if kind == "agent":
            k = int(rng.choice(m.manifests, p=mw))
            ctx += [("tools", k, j) for j in range(mlen[k])]
        elif kind == "rag":
            d = int(rng.choice(m.docs, p=dw))
            ctx += [("doc", d, j) for j in range(dlen[d])]
        left = 1 if kind == "scan" else int(rng.geometric(1.0 / max(1.0, m.turns)))
        return {"kind": kind, "ctx": ctx, "left": left}

    out: list[list[int]] = []
    live = [new_session(0.0) for _ in range(m.active)]
    while len(out) < requests:
        i = int(rng.integers(len(live)))
        s = live[i]
        ctx = s["ctx"]
        kind = s["kind"]
        if kind == "agent":
            add = [("out", next(uniq)) for _ in range(int(rng.integers(*m.tool_blocks, endpoint=True)))]
        elif kind == "scan":
            add = [("once", next(uniq)) for _ in range(int(rng.integers(4, 32)))]
        else:
            add = [("turn", next(uniq)) for _ in range(int(rng.integers(*m.turn_blocks, endpoint=True)))]
        ctx.extend(add)
        out.append(ch.ids(ctx))
        ctx.append(("reply", next(uniq)))  # the answer becomes part of the next turn's prompt
        s["left"] -= 1
        if s["left"] <= 0:
            live[i] = new_session(len(out) / requests)
    return out


#: name -> (mix, requests); every member is rerun with its seed by the policy sweep
FAMILY: dict[str, tuple[Mix, int]] = {
    "chat-zipf0.8": (Mix(zipf=0.8, turns=6, active=128), 4000),
    "chat-zipf1.2-short": (Mix(zipf=1.2, turns=2, active=32, prompts=50), 5000),
    "agents-long-tools": (Mix(chat=0.2, agent=0.8, tool_blocks=(3, 10), turns=8, active=64), 3000),
    "agents-short-tools": (Mix(chat=0.2, agent=0.8, tool_blocks=(1, 2), turns=12, active=96), 4000),
    "rag-shared-docs": (Mix(chat=0.3, rag=0.7, docs=400, zipf=1.0, turns=3, active=64), 4000),
    "chat-agents-rag": (Mix(chat=0.4, agent=0.3, rag=0.3, zipf=1.1, turns=5, active=128), 4000),
    "scan-heavy": (Mix(chat=0.4, rag=0.2, scan=0.4, turns=4, active=64), 4000),
    "diurnal-mix": (Mix(chat=0.5, agent=0.25, rag=0.25, diurnal=True, turns=5, active=160), 5000),
    "long-sessions-long-gaps": (Mix(chat=0.7, agent=0.3, turns=20, active=400), 5000),
}


def family(seed: int = 0) -> dict[str, Callable[[], list[list[int]]]]:
    """Lazy constructors of every member, seeded."""
    return {name: (lambda m=m, n=n, s=k + seed: generate(m, n, s))
            for k, (name, (m, n)) in enumerate(FAMILY.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(FAMILY))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    reqs = family(a.seed)[a.name]()
    f = sys.stdout if a.out == "-" else open(a.out, "w")
    with f:
        for i, r in enumerate(reqs):
            f.write(json.dumps({"timestamp": i, "hash_ids": r}) + "\n")


if __name__ == "__main__":
    main()
