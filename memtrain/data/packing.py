"""Where tokens sit in the packed stream (its layout: stream.py): canary copies placed one per stratum of the pass,
the stream array packed around them, positions inside documents and rows, the step and data-parallel rank of a
row, and where a token sequence occurs."""

from __future__ import annotations

import numpy as np

from memtrain.data.canaries import Canary, Placement

PAD = -1  # in the stream array only; batches show padding as EOS inputs with label -100


def locate(seq_index: int, batch_size: int, data_shards: int = 1) -> tuple[int, int]:
    """(step, data-parallel rank) of a sequence: global batches are consecutive rows, and shard r of D
    holds the contiguous block [r*B/D, (r+1)*B/D) of each batch."""
    if batch_size < 1 or data_shards < 1 or batch_size % data_shards:
        raise ValueError(f"batch_size={batch_size} must be a positive multiple of data_shards={data_shards}")
    return seq_index // batch_size, (seq_index % batch_size) // (batch_size // data_shards)


def document_positions(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Position of every token inside its document (0 right after EOS, padding or the stream start)."""
    n = len(tokens)
    starts = np.zeros(n, dtype=bool)
    starts[0] = True
    starts[1:] = (tokens[:-1] == eos_id) | (tokens[:-1] == PAD)
    idx = np.arange(n, dtype=np.int64)
    return (idx - np.maximum.accumulate(np.where(starts, idx, 0))).astype(np.int32)


def row_positions(input_ids: np.ndarray, eos_id: int) -> np.ndarray:
    """Position ids [B, S] that restart at every EOS input (position 0 of the document it opens) and at
    every row start: what document attention feeds the model."""
    starts = input_ids == eos_id
    starts[:, 0] = True
    idx = np.broadcast_to(np.arange(input_ids.shape[1]), input_ids.shape)
    return idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)


def occurrences(tokens: np.ndarray, ids: list[int]) -> list[int]:
    """Every start index of the token sequence `ids` in `tokens` (byte search, fast on long streams)."""
    hay = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
    needle = np.asarray(ids, dtype=np.int32).tobytes()
    found, i = [], hay.find(needle)
    while i >= 0:
        if i % 4 == 0:  # a match must start on a token boundary
            found.append(i // 4)
        i = hay.find(needle, i + 1)
    return found


def place(canaries: list[Canary], n_seq: int, S: int, placement, rng: np.random.Generator) -> None:
    """Give every copy its own row, one per equal stratum of the pass, so copies spread evenly."""
    copies = [c for c in canaries for _ in range(c.copies)]
    M = len(copies)
    if M == 0:
        return
    bounds = np.arange(M + 1) * n_seq // M
    rows = rng.integers(bounds[:-1], bounds[1:])  # one row in each stratum (every stratum is non-empty)
    for stratum, j in enumerate(rng.permutation(M)):
        c = copies[j]
        room = S - len(c.token_ids)  # largest offset where the canary still fits
        if placement == "start":
            offset = 1
        elif placement == "random":
            offset = int(rng.integers(1, room + 1))
        elif placement > room:
            raise ValueError(f"canaries.placement={placement} puts canary {c.id} ({len(c.token_ids)} tokens) "
                             f"past seq_len={S}: use an offset in [1, {room}]")
        else:
            offset = placement
        c.placements.append(Placement(seq_index=int(rows[stratum]), offset=offset))
    for c in canaries:
        c.placements.sort(key=lambda p: p.seq_index)


def pack(text: np.ndarray, canaries: list[Canary], n_seq: int, S: int, eos: int) -> np.ndarray:
    """The stream array T: every copy as EOS, canary, EOS where `place` put it, the text in the free slots in order,
    PAD after it."""
    T = np.full(n_seq * S + 1, PAD, dtype=np.int32)
    used = np.zeros(len(T), dtype=bool)
    for c in canaries:
        seg = np.array([eos, *c.token_ids, eos], dtype=np.int32)
        for p in c.placements:
            a = p.seq_index * S + p.offset - 1
            T[a:a + len(seg)] = seg  # neighbouring copies may share a boundary EOS, never a token
            used[a:a + len(seg)] = True
    free = np.flatnonzero(~used)
    assert len(free) >= len(text), "n_seq leaves room for all text by construction"
    T[free[:len(text)]] = text
    return T
