"""data.packing: whole documents packed into rows, each row a pure function of (seed, step, row).

A plan is made once per sequence length from the document lengths alone (no token is read):
documents fill rows of seq_len + 1 tokens best-fit decreasing (longest first, each into the open
row it fills most tightly, a new row when none has room), so a document shorter than a row is
never cut. A document longer than a row is cut into pieces of seq_len + 1 tokens overlapping by
one token (each a row of its own, so every target inside the document is in exactly one row),
its last piece packed like a short document. "Not read" is nearly true: one token per document, its last,
says whether it ends with EOS. The rest of a row is padding: EOS tokens, whose targets the loss
skips (jaxpar/train/batch.py reads the documents back from the EOS tokens). Row i of step s is
plan row hash(seed, s, i) mod rows, drawn as the stream source draws its windows: resuming at
any step replays nothing, and each host reads only the tokens of its own rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data.binfile import check_ids
from jaxpar.data.keys import row_keys

_SALT = 0x5041434B  # "PACK": the random streams of the plan's tie order and of the row draws


@dataclass(frozen=True)
class Plan:
    """Rows of one sequence length: row r holds pieces ptr[r]:ptr[r + 1], piece i the tokens
    start[i]:start[i] + length[i] of document doc[i], then an EOS when eos[i] (a document that
    did not end with one)."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    eos: np.ndarray
    ptr: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.ptr) - 1

    def padding_fraction(self, row_len: int) -> float:
        return 1.0 - float((self.length + self.eos).sum()) / (self.rows * row_len)


def plan_rows(lengths: np.ndarray, add_eos: np.ndarray, row_len: int, seed: int) -> Plan:
    """The packing plan of documents of `lengths` tokens (plus one EOS where `add_eos`) into rows
    of `row_len` tokens, best-fit decreasing: the pieces, longest first (ties in an order shuffled
    by `seed`), each into the open row it fills most tightly; piece starts are offsets into each
    document (see PackedSource)."""
    order = np.random.default_rng([seed & 0xFFFF_FFFF, _SALT]).permutation(len(lengths))
    pieces = []  # (total tokens with the added EOS, document, offset, tokens read, adds an EOS)
    for d in order.tolist():
        n, add = int(lengths[d]), bool(add_eos[d])
        a, total = 0, n + add
        if total < 2:  # no target inside
            continue
        while total > row_len:  # the next piece starts on this one's last token
            pieces.append((row_len, d, a, row_len, False))
            a, n, total = a + row_len - 1, n - (row_len - 1), total - (row_len - 1)
        pieces.append((total, d, a, n, add))
    pieces.sort(key=lambda p: -p[0])  # stable: ties keep the shuffled order
    rows: list[list[tuple]] = []
    open_rows: list[list[int]] = [[] for _ in range(row_len + 1)]  # free tokens -> rows with that many
    free = 0  # bit c set: some open row has exactly c free tokens
    for piece in pieces:
        need = piece[0]
        fits = free >> need
        if fits:  # the open row with the fewest free tokens that still holds the piece
            c = need + (fits & -fits).bit_length() - 1
            r = open_rows[c].pop()
            if not open_rows[c]:
                free &= ~(1 << c)
        else:
            r, c = len(rows), row_len
            rows.append([])
        rows[r].append(piece)
        if c - need >= 2:  # room for a document with a target
            open_rows[c - need].append(r)
            free |= 1 << (c - need)
    if not rows:
        raise ConfigError("data.packing: the corpus has no document of two or more tokens to train on")
    flat = [p for row in rows for p in row]
    ptr = np.concatenate([[0], np.cumsum([len(row) for row in rows])])
    col = lambda i, dt: np.asarray([p[i] for p in flat], dt)
    return Plan(col(1, np.int64), col(2, np.int64), col(3, np.int64), col(4, bool), ptr.astype(np.int64))


@dataclass(eq=False)
class PackedSource:
    """A TokenSource of packed rows of the documents [starts[i], ends[i]) of `tokens` (an array
    or memmap), each ending with `eos_id` or given one; a row is drawn per (seed, step, row) by
    the same counter hash as the stream source's windows. `name`: the config field in errors."""

    tokens: np.ndarray = field(repr=False)
    starts: np.ndarray = field(repr=False)
    ends: np.ndarray = field(repr=False)
    eos_id: int
    seed: int
    name: str
    vocab_size: int | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    def plan(self, seq_len: int) -> Plan:
        if seq_len not in self._plans:
            lengths = self.ends - self.starts
            last = np.full(len(lengths), -1, np.int64)
            some = lengths > 0
            last[some] = np.asarray(self.tokens[self.ends[some] - 1])
            self._plans[seq_len] = plan_rows(lengths, last != self.eos_id, seq_len + 1, self.seed)
        return self._plans[seq_len]

    def row(self, plan: Plan, r: int, seq_len: int) -> np.ndarray:
        """Plan row r: its pieces, then EOS padding (int64 [seq_len + 1])."""
        out = np.full(seq_len + 1, self.eos_id, np.int64)
        pos = 0
        for p in range(plan.ptr[r], plan.ptr[r + 1]):
            a, n = int(self.starts[plan.doc[p]] + plan.start[p]), int(plan.length[p])
            out[pos:pos + n] = np.asarray(self.tokens[a:a + n])
            pos += n + int(plan.eos[p])  # the added EOS is the fill already there
        return out

    def rows(self, step: int, row_indices: np.ndarray, seq_len: int) -> np.ndarray:
        plan = self.plan(seq_len)
        picked = row_keys(self.seed, step, row_indices, _SALT) % np.uint64(plan.rows)
        out = np.full((len(picked), seq_len + 1), self.eos_id, np.int64)
        for i, r in enumerate(picked.tolist()):
            out[i] = self.row(plan, r, seq_len)
        if self.vocab_size is not None:
            check_ids(out, self.vocab_size, self.name)
        return out.astype(np.int32)


def eos_boundaries(tokens: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the documents of a stream in which each document ends with `eos_id` (a
    tail without one is a document too)."""
    ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
    n = int(tokens.shape[0])
    if not ends.size or ends[-1] != n:
        ends = np.append(ends, n)
    starts = np.concatenate([[0], ends[:-1]])
    return starts.astype(np.int64), ends.astype(np.int64)
