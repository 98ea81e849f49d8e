"""Turns a list of rows (slot, start, new tokens) into one padded target forward.

Prefill chunks, plain decode and "last token + K drafts" verification are the same call. Logits are
computed only for the positions asked for; hidden states of chosen layers are returned on request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.layers.attention import AttnContext
from verispec.models.decoder import DecoderLM
from verispec.runner.kv_cache import KVCache


@dataclass
class RowInput:
    slot: int
    # cache index of the first new token (= tokens already cached)
    start: int
    # new tokens to score
    token_ids: list[int]
    # logits are returned for token_ids[logits_from:]
    logits_from: int = 0
    # [q, q] bool ancestor-or-self; None = a chain
    tree_mask: torch.Tensor | None = None
    # RoPE offsets within a tree; None = 0..q-1
    depths: list[int] | None = None


@dataclass
class RunnerOutput:
    # [N, V] for every requested position, rows in input order
    logits: torch.Tensor
    # [N, hidden] final normed hidden at the same positions
    hidden: torch.Tensor
    # the aux layers' streams side by side [N, len(aux_layers) * hidden] (with aux_all: of every packed token), or
    # None without aux layers
    aux_hidden: torch.Tensor | None
    # with hidden_all: final normed hidden of every packed token
    hidden_all: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: DecoderLM, cache: KVCache, device: torch.device):
        self.model, self.cache, self.device = model, cache, device
        self.window = model.cfg.sliding_window if model.cfg.layer_types else None
        # [S, 1] aranges by S (read-only; made once)
        self._slot_rows: dict[int, torch.Tensor] = {}

    def build_context(
        self, rows: list[RowInput]
    ) -> tuple[torch.Tensor, torch.Tensor, AttnContext, list[int]]:
        """-> (packed input ids [N], RoPE positions [S, Q], context, packed indices of the logits rows).

        Tokens are packed in input-row order: projections and MLPs only ever see the N real tokens; attention
        works on the padded [S, Q] layout of the slot range, gathering/scattering only when rows are ragged.
        """
        lo = min(r.slot for r in rows)
        hi = max(r.slot for r in rows) + 1
        s, q = hi - lo, max(len(r.token_ids) for r in rows)
        start, qlen = [0] * s, [0] * s
        depth = [list(range(q)) for _ in range(s)]
        packed_ids: list[int] = []
        # padded flat position of each packed token
        pad_pos: list[int] = []
        flat: list[int] = []
        for r in rows:
            i, n = r.slot - lo, len(r.token_ids)
            start[i], qlen[i] = r.start, n
            if r.depths is not None:
                depth[i][:n] = r.depths
            flat.extend(range(len(packed_ids) + r.logits_from, len(packed_ids) + n))
            pad_pos.extend(range(i * q, i * q + n))
            packed_ids.extend(r.token_ids)
        dev = self.device
        # [N]
        ids_t = torch.tensor(packed_ids, dtype=torch.long, device=dev)
        # [S, 1]
        start_t = torch.tensor(start, device=dev)[:, None]
        kv_len = max(st + ql for st, ql in zip(start, qlen))
        trees = any(r.tree_mask is not None for r in rows)
        # chains filling every slot in range (no padding, no trees, no depths): batch-1 decoding and verification,
        # a batch that decodes one token each. Positions and mask follow from the start positions alone
        dense = (
            not trees
            and all(n == q for n in qlen)
            and all(r.depths is None or list(r.depths) == list(range(q)) for r in rows)
        )
        # plain decoding of every slot in range: one token each, at its sequence's next position
        one_each = dense and q == 1
        # [S] real rows per sequence
        qlen_t = None if dense else torch.tensor(qlen, device=dev)
        valid = None
        if one_each:
            # [S, 1]
            cache_pos = positions = start_t
        elif dense:
            # [S, Q]
            cache_pos = positions = start_t + torch.arange(q, device=dev)[None]
        else:
            # [1, Q]
            j = torch.arange(q, device=dev)[None]
            # [S, Q]
            valid = j < qlen_t[:, None]
            # [S, Q]
            cache_pos = torch.where(valid, start_t + j, self.cache.scratch)
            # [S, Q]
            positions = torch.where(valid, start_t + torch.tensor(depth, device=dev), 0)
        if s == 1 and q == 1:
            mask = None
        elif dense:
            # [S, 1, Q, T]: each query sees its sequence's keys up to its own
            mask = (torch.arange(kv_len, device=dev)[None, None] <= cache_pos[:, :, None])[:, None]
        else:
            tree_mask = self._mask(start_t, valid, positions, kv_len, rows, lo, q) if trees else None
            mask = _padded_mask(tree_mask, start_t, valid, kv_len)
        sliding = None if self.window is None else self._sliding(mask, positions, valid, kv_len)
        # [S, 1]
        rows_idx = self._slot_rows.get(s)
        if rows_idx is None:
            rows_idx = self._slot_rows[s] = torch.arange(s, device=dev)[:, None]
        unpack, pack, lengths = _packing(pad_pos, s, q, qlen_t, dev)
        ctx = AttnContext(lo, hi, rows_idx, cache_pos, kv_len, mask, sliding, q, unpack, pack, lengths)
        ctx.blocks, ctx.block_shift = self.cache.block_table[lo:hi], self.cache.block_shift
        return ids_t, positions, ctx, flat

    def _sliding(
        self, mask: torch.Tensor | None, positions: torch.Tensor, valid: torch.Tensor | None, kv_len: int
    ) -> torch.Tensor:
        """[S, 1, Q, T] the mask of the sliding-window layers: the full mask within `window` keys of each query."""
        key = torch.arange(kv_len, device=positions.device)[None, None, None]
        near = key > positions[:, None, :, None] - self.window
        sliding = (mask if mask is not None else torch.ones_like(near)) & near
        if valid is not None:
            # padded queries look at one key
            sliding[..., 0] |= ~valid[:, None]
        return sliding

    def _mask(self, start_t, valid, positions, kv_len, rows, lo, q) -> torch.Tensor:
        """Prefix keys plus ancestor-or-self keys inside each row's tree. -> [S, Q, T]."""
        s = valid.shape[0]
        tree = torch.zeros(s, q, q, dtype=torch.bool, device=self.device)
        for r in rows:
            n = len(r.token_ids)
            m = r.tree_mask if r.tree_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
            tree[r.slot - lo, :n, :n] = m.to(self.device)
        # [1, T]
        key = torch.arange(kv_len, device=self.device)[None]
        # [S, T]
        rel = key - start_t
        in_new = (rel >= 0) & (rel < q)
        # [S, Q, T]
        idx = rel.clamp(0, q - 1)[:, None, :].expand(s, q, kv_len)
        from_tree = torch.gather(tree, 2, idx) & in_new[:, None, :]
        return (rel < 0)[:, None, :] | from_tree

    @torch.inference_mode()
    def run(
        self,
        rows: list[RowInput],
        aux_layers: tuple[int, ...] = (),
        aux_all: bool = False,
        hidden_all: bool = False,
    ) -> RunnerOutput:
        """aux_all / hidden_all: the aux layers' states / the final normed hidden of every scored token (rows' tokens
        in order), not only of the logits positions."""
        ids, positions, ctx, flat = self.build_context(rows)
        hidden, aux = self.model(ids, positions, ctx, self.cache.kv, aux_layers)
        if len(flat) == hidden.shape[0]:
            sel, aux_sel = hidden, aux
        else:
            # may be empty: a mid-prompt chunk
            idx = torch.tensor(flat, dtype=torch.long, device=self.device)
            # [n_logits, hidden]
            sel = hidden.index_select(0, idx)
            aux_sel = aux if aux_all or aux is None else aux.index_select(0, idx)
        return RunnerOutput(self.model.compute_logits(sel), sel, aux_sel, hidden if hidden_all else None)


def _padded_mask(
    tree_mask: torch.Tensor | None, start_t: torch.Tensor, valid: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """[S, 1, Q, T] the mask of ragged rows: causal over each sequence's keys (or the rows' tree masks), padded
    queries looking at one key (no NaN rows)."""
    q = valid.shape[1]
    if tree_mask is None:
        key = torch.arange(kv_len, device=valid.device)[None, None]
        j = torch.arange(q, device=valid.device)[None]
        # [S, Q, T]
        tree_mask = key <= (start_t + j)[:, :, None]
    mask = tree_mask & valid[:, :, None]
    mask[:, :, 0] |= ~valid
    return mask[:, None]


def _packing(
    pad_pos: list[int], s: int, q: int, qlen_t: torch.Tensor | None, dev: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(unpack [S*Q], pack [N], lengths [S]) between the packed tokens and the padded [S, Q] layout; all None when
    every slot in range is full (the layouts coincide)."""
    if pad_pos == list(range(s * q)):
        return None, None, None
    # [N] padded position of each packed token
    pack = torch.tensor(pad_pos, device=dev)
    # [S*Q] padding reads row 0 (masked)
    unpack = torch.zeros(s * q, dtype=torch.long, device=dev)
    unpack[pack] = torch.arange(len(pad_pos), device=dev)
    # the kernels skip the padding
    return unpack, pack, qlen_t
