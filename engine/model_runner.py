"""Runs one scheduled step through the model: builds the flat batch and attention metadata, encodes pending
images (with a content-hash cache), runs the decoder, and returns logits for the rows that sample.

Owns the KV pool tensors (per KV layer ``(k, v)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``), the
decode mirror (:mod:`engine.decode_mirror`) and, for hybrid models, the GDN layers' state slots
(:mod:`engine.state_cache`; a sequence's slot is ``Sequence.state_slot``, given by the block manager).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from engine.attention import (
    AttentionMetadata,
    DecodeBatch,
    LayerKV,
    PrefillSpan,
    causal_mask_with_prefix,
    decode_mask,
)
from engine.coded_kv import CodedKV, coded_rows, gather_coded, page_capacity, plain_table, write_pages
from engine.decode_mirror import DecodeKVMirror
from engine.layers import RotaryEmbedding
from engine.model import LlavaModel
from engine.moe import SparseMoe
from engine.mrope import MRotaryEmbedding, positions as mrope_positions
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence
from engine.state_cache import LayerState, StateCache, StateStep
from engine.vision_cache import VisionCache, VisionEntry
from engine.workspace import workspace_groups


class ModelRunner:
    def __init__(self, model: LlavaModel, *, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 dtype: torch.dtype, device: torch.device, vision_cache_size: int = 64,
                 vision_cache_bytes: int = 256 * 2**20,
                 mirror_tokens: int | None = None, num_state_slots: int = 0, track_routing: bool = False,
                 query_window: int = 0, workspace: int = 0) -> None:
        """``track_routing``, ``query_window``: the owner's :class:`engine.hooks.EngineHooks` switches, fixed here.
        ``workspace``: bytes a tower call may hold (engine.workspace; 0: unbounded, one call a step)."""
        t = model.cfg.text
        self.model, self.block_size, self.dtype, self.device = model, block_size, dtype, device
        self.workspace = workspace
        self._moe_cache: list[SparseMoe] | None = None
        shape = (num_blocks, block_size, t.num_kv_heads, t.head_dim)
        self.kv_index = {layer: i for i, layer in enumerate(t.kv_layers)}  # decoder layer -> pool entry
        self.pool = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                     for _ in t.kv_layers]
        self.state_index = {layer: i for i, layer in enumerate(t.state_layers)}  # decoder layer -> state entry
        self.state = (StateCache(t.gdn, len(t.state_layers), num_state_slots, dtype, device)
                      if t.gdn is not None and num_state_slots else None)
        reserve = {} if mirror_tokens is None else {"initial_capacity": mirror_tokens, "initial_slots": max_num_seqs}
        self.page_capacity = page_capacity(block_size, t.head_dim, torch.empty(0, dtype=dtype).element_size())
        self.mirror = DecodeKVMirror(len(self.pool), max_num_seqs, t.num_kv_heads, t.head_dim, dtype, device,
                                     **reserve)
        self.rope: RotaryEmbedding | MRotaryEmbedding = (
            RotaryEmbedding(t.rope_dim, t.rope_theta, max_model_len, device) if t.mrope_section is None
            else MRotaryEmbedding(t.rope_dim, t.rope_theta, max_model_len, t.mrope_section, device))
        self.mrope = t.mrope_section is not None
        self.vision_cache = VisionCache(vision_cache_bytes, vision_cache_size)
        self.query_window = query_window  # > 0: keep the last queries of completing prompts per layer (KV importance)
        self.captured_queries: dict[int, torch.Tensor] = {}  # seq_id -> this layer's window, during a step
        # after execute: (sequence, first prompt position, float32 logits [chunk, vocab]) of the prompt chunks whose
        # sequences asked for prompt logprobs
        self.prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = []
        for m in self._moe_layers():  # none in a dense model: tracking is then off whatever was asked
            m.record_routing = track_routing

    @property
    def kv_bytes_per_token(self) -> int:
        k, _ = self.pool[0]
        return 2 * len(self.pool) * k.shape[2] * k.shape[3] * k.element_size()

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def pool_nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.pool)

    def kv_layers(self) -> list[LayerKV | LayerState]:
        """Each decoder layer's cache: its KV (pool + mirror) or, in a hybrid model's GDN layers, its state."""
        kv = [LayerKV(k, v, mk, mv, i)
              for i, ((k, v), mk, mv) in enumerate(zip(self.pool, self.mirror.k, self.mirror.v, strict=True))]
        if not self.state_index:
            return kv  # type: ignore[return-value]
        assert self.state is not None
        return [kv[self.kv_index[i]] if i in self.kv_index else self.state.layers[self.state_index[i]]
                for i in range(len(self.model.text.layers))]

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s decode staging (call when it finishes, is aborted or preempted). A preempted sequence
        recomputes its whole prompt here, so dropped-token marks from a transfer no longer apply."""
        self.mirror.release(seq.seq_id)
        seq.kv_dropped, seq.kv_lossy = None, False

    def encode_pending_images(self, seqs: list[Sequence], fresh: dict[bytes, VisionEntry] | None = None) -> None:
        """Compute image features for sequences scheduled for the first time, reusing cached encodings (and
        ``fresh``: encodings just made, which an image too large to cache is only in). The distinct images not
        cached are encoded together (Qwen3-VL images of any sizes in one call, each attending only within itself),
        in as few tower calls as keep within the workspace (:func:`engine.workspace.workspace_groups`). Cached
        entries are taken before the calls, so what they add to the cache cannot push them out."""
        have = dict(fresh or {})
        todo: dict[bytes, tuple[Sequence, int]] = {}  # one encoding per distinct image, however often it appears
        waiting: list[Sequence] = []  # the requests that wait for this step's tower call (its time is theirs)
        pending = [seq for seq in seqs if seq.mm is not None and seq.mm.features is None]
        for seq in pending:
            for i, h in enumerate(seq.mm.image_hashes):
                if h not in have and h not in todo:
                    entry = self.vision_cache.get(h)
                    if entry is not None:
                        have[h] = entry
                    else:
                        todo[h] = (seq, i)
            if any(h in todo for h in seq.mm.image_hashes):
                waiting.append(seq)
        if todo:
            t0 = time.perf_counter()
            for group in workspace_groups(todo, self.model.cfg, self.workspace, self.dtype.itemsize):
                have.update(self._encode(group))
            spent = time.perf_counter() - t0
            for seq in waiting:
                seq.metrics.vision_s += spent
        for seq in pending:
            rows = [have[h] for h in seq.mm.image_hashes]
            seq.mm.features = torch.cat([r.features for r in rows], dim=0)
            if self.model.cfg.is_qwen_vl:
                seq.mm.deepstack = None if rows[0].deepstack is None else torch.cat([r.deepstack for r in rows], 1)

    def clear_vision_cache(self) -> int:
        return self.vision_cache.clear()

    def grid_inputs(self, todo: dict[bytes, tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        patches = torch.cat([s.mm.pixels()[s.mm.patch_rows(i)] for s, i in todo.values()]).to(self.device)
        return patches, torch.from_numpy(np.stack([s.mm.grid_thw[i] for s, i in todo.values()]))

    def _encode(self, todo: dict[bytes, tuple[Sequence, int]]) -> dict[bytes, VisionEntry]:
        if not self.model.cfg.is_qwen_vl:
            pixels = torch.stack([s.mm.pixels()[i] for s, i in todo.values()]).to(self.device)
            return {h: self.vision_cache.put(h, f)
                    for h, f in zip(todo, self.model.encode_images(pixels), strict=True)}
        return self.cache_grid_features(todo, *self.model.encode_grid_images(*self.grid_inputs(todo)))

    def cache_grid_features(self, todo: dict[bytes, tuple[Sequence, int]], feats: torch.Tensor,
                            deepstack: torch.Tensor | None) -> dict[bytes, VisionEntry]:
        """Qwen3-VL: one tower call's rows, split per image into the vision cache; returns each image's entry."""
        start, made = 0, {}
        for h, (s, i) in todo.items():
            r = s.mm.image_rows(i)
            n = r.stop - r.start
            made[h] = self.vision_cache.put(h, feats[start:start + n],
                                            None if deepstack is None else deepstack[:, start:start + n])
            start += n
        return made

    def _positions(self, seq: Sequence, start: int, n: int) -> np.ndarray:
        """Rotary positions of sequence indices [start, start + n): [n], or [3, n] under M-RoPE."""
        if not self.mrope:
            return np.arange(start, start + n)
        mm = seq.mm
        return mrope_positions(None if mm is None else mm.mrope, 0 if mm is None else mm.mrope_delta, start, n)

    def _slots(self, seq: Sequence, start: int, n: int) -> np.ndarray:
        pos = np.arange(start, start + n)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                        tuple[torch.Tensor, torch.Tensor] | None, list[int],
                                                        list[ScheduledSeq]]:
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        spans: list[PrefillSpan] = []
        mm_idx: list[np.ndarray] = []
        mm_rows: list[torch.Tensor] = []
        ds_rows: list[torch.Tensor] = []  # DeepStack features of the same rows, [levels, rows, hidden]
        logit_rows: list[int] = []
        self._prompt_rows: list[tuple[Sequence, int, int, int]] = []  # (seq, first row, first position, rows)
        dev = self.device
        for s in sched.prefills:
            seq, c, n = s.seq, s.seq.num_computed_tokens, s.num_tokens
            start = len(ids)
            ids.extend(seq.token_ids[c:c + n])
            positions.append(self._positions(seq, c, n))
            slots.append(self._slots(seq, c, n))
            table = None if c == 0 else torch.tensor(seq.block_table[: -(-(c + n) // self.block_size)], device=dev)
            mask = None if c == 0 else causal_mask_with_prefix(n, c + n, dev)
            capture = seq.seq_id if self.query_window and s.samples and seq.num_output_tokens == 0 else None
            spans.append(PrefillSpan(start, n, c + n, table, mask, capture))
            if seq.mm is not None and c < seq.num_prompt_tokens:
                lo, hi = np.searchsorted(seq.mm.positions, [c, c + n])
                if hi > lo:
                    mm_idx.append(seq.mm.positions[lo:hi] - c + start)
                    mm_rows.append(seq.mm.features[lo:hi])
                    if seq.mm.deepstack is not None:
                        ds_rows.append(seq.mm.deepstack[:, lo:hi])
            if s.samples:
                logit_rows.append(start + n - 1)
            if seq.params.prompt_logprobs is not None and c < seq.num_prompt_tokens:
                self._prompt_rows.append((seq, start, c, min(n, seq.num_prompt_tokens - c)))
        num_prefill = len(ids)
        decode = None
        order = list(sched.prefills)
        if sched.decodes:
            placed, longest = self.mirror.slot_of, 0
            for s in sched.decodes:  # a sequence already placed only needs room for its next token: once below
                c = s.seq.num_computed_tokens - (s.seq.coded.num_tokens if s.seq.coded else 0)  # its mirror index
                if s.seq.seq_id in placed:
                    longest = max(longest, c + 1)
                else:
                    self.mirror.assign(s.seq.seq_id, c, self.pool, plain_table(s.seq), c + 1, s.seq.kv_dropped)
            if longest:
                self.mirror.ensure_length(longest)
            slot_of = self.mirror.slot_of
            decodes = sorted(sched.decodes, key=lambda s: slot_of[s.seq.seq_id])
            order += decodes
            b, bs = len(decodes), self.block_size
            seqs = [s.seq for s in decodes]
            computed = [q.num_computed_tokens for q in seqs]  # a decode row's position
            ids += [q.token_ids[c] for q, c in zip(seqs, computed, strict=True)]
            coded = [q.coded for q in seqs]
            lens = np.array([c + 1 - (q.num_tokens if q else 0) for c, q in zip(computed, coded, strict=True)])
            slot_ids = np.array([slot_of[q.seq_id] for q in seqs], dtype=np.int64)
            slots.append(np.array([q.block_table[c // bs] * bs + c % bs for q, c in zip(seqs, computed, strict=True)],
                                  dtype=np.int64))
            logit_rows += range(num_prefill, num_prefill + b)
            for j, (seq, c) in enumerate(zip(seqs, computed, strict=True)):
                if seq.mm is not None and c < seq.num_prompt_tokens:
                    r = int(np.searchsorted(seq.mm.positions, c))
                    if r < len(seq.mm.positions) and seq.mm.positions[r] == c:
                        mm_idx.append(np.array([num_prefill + j]))
                        mm_rows.append(seq.mm.features[r:r + 1])
                        if seq.mm.deepstack is not None:
                            ds_rows.append(seq.mm.deepstack[:, r:r + 1])
            if self.mrope:
                positions.append(np.concatenate([self._positions(s.seq, s.seq.num_computed_tokens, 1)
                                                 for s in decodes], axis=1))
            else:
                positions.append(np.array(computed, dtype=np.int64))
            max_len = int(lens.max())
            lens_t = torch.from_numpy(lens).to(dev)
            dense = bool((slot_ids == np.arange(b)).all())
            slots_t = torch.from_numpy(slot_ids).to(dev)
            seq_ids = [s.seq.seq_id for s in decodes]
            layer_masks = None
            if self.mirror.has_drops(seq_ids):  # else the mask is built only if a layer reads it
                layer_masks = self.mirror.layer_masks(seq_ids, slots_t, decode_mask(lens_t, max_len, self.dtype))
            rows = coded_rows(coded, lens, self.page_capacity)
            decode = DecodeBatch(slots_t, lens_t - 1, max_len, dense, None, layer_masks, rows)
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev), prefills=spans,
                                 num_prefill_tokens=num_prefill, decode=decode, query_window=self.query_window)
        if self.state is not None:
            for s in order:  # a hybrid prefix hit resumes from the GDN state kept after its last block (its one
                if s.seq.state_restore is not None:  # token left may run as a decode row)
                    self.copy_state(s.seq.state_restore, s.seq.state_slot)
            snaps = [[(b - s.seq.num_computed_tokens, slot) for b, slot in s.seq.snapshot_writes]
                     for s in sched.prefills]
            meta.state = StateStep([s.seq.state_slot for s in sched.prefills], torch.tensor(
                [s.seq.state_slot for s in order[len(sched.prefills):]], dtype=torch.long, device=dev)
                if sched.decodes else None, snaps if any(snaps) else None)
        if self.query_window:
            self.captured_queries = meta.captured = {}
        mm = None
        if mm_idx:
            assert not ds_rows or len(ds_rows) == len(mm_rows), "every image row has DeepStack features or none does"
            mm = (torch.from_numpy(np.concatenate(mm_idx)).to(dev), torch.cat(mm_rows, dim=0),
                  torch.cat(ds_rows, dim=1) if ds_rows else None)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.from_numpy(np.concatenate(positions, axis=-1)).to(dev)
        return input_ids, pos, meta, mm, logit_rows, [s for s in order if s.samples]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, export: Callable[[int, list[Sequence]], None] | None = None
                ) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run the step. Returns float32 logits [S, vocab] for the scheduled sequences that sample, and those
        sequences in row order (prefills first, then decodes in mirror-slot order).

        ``export(layer, seqs)``, if given, is called right after each decoder layer with the sequences whose prompt
        KV for that layer became complete in this step (the pool holds it from then on).
        """
        # only a step that computes prompt positions can need image features: a sequence whose prompt KV came from
        # another worker decodes without them (its images are encoded only if a preemption recomputes the prompt)
        self.encode_pending_images([s.seq for s in sched.prefills + sched.decodes
                                    if s.seq.num_computed_tokens < s.seq.num_prompt_tokens])
        input_ids, pos, meta, mm, logit_rows, sampling = self.prepare(sched)
        completing = [s.seq for s in sampling if s.seq.num_output_tokens == 0]
        if export is not None and completing:
            meta.on_layer = lambda layer: export(layer, completing)
        hidden = self.model(input_ids, self.rope.tables(pos, self.dtype), meta, self.kv_layers(), mm)
        if self.track_routing:
            self._accumulate_routing(sched)
        self.prompt_logits = [(seq, c, self.model.text.logits(hidden[start:start + n]))
                              for seq, start, c, n in self._prompt_rows]
        if len(logit_rows) == hidden.shape[0]:  # every row samples (rows ascend, so they are 0..n-1): no copy
            return self.model.text.logits(hidden), sampling
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return self.model.text.logits(hidden.index_select(0, rows)), sampling

    # ------------------------------------------------------------------ disaggregation: KV export/import, routing hints
    def gather_layer(self, seq: Sequence, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``seq``'s blocks for ``layer``: two ``[num_blocks, block_size, kv_heads, head_dim]`` tensors
        (coded blocks dequantized)."""
        table = torch.tensor(seq.block_table, dtype=torch.long, device=self.device)
        k, v = self.pool[self.kv_index[layer]]
        if seq.coded is None:
            return k.index_select(0, table), v.index_select(0, table)
        return gather_coded(k, v, table, seq.coded, self.page_capacity)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy pool block ``src``'s KV into ``dst``, every layer (an ``n > 1`` choice's copy of the prompt's partial
        last block, :meth:`engine.block_manager.BlockManager.fork`)."""
        for k, v in self.pool:
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    def copy_state(self, src: int, dst: int) -> None:
        """Copy state slot ``src`` into ``dst``, every GDN layer (an ``n > 1`` choice of a hybrid model)."""
        if self.state is not None:
            for s in self.state.layers:
                s.conv[dst].copy_(s.conv[src])
                s.recurrent[dst].copy_(s.recurrent[src])

    def write_layer(self, block_ids: list[int], layer: int, k: torch.Tensor, v: torch.Tensor,
                    coded: CodedKV | None = None) -> None:
        """Store received blocks (``[len(block_ids), block_size, kv_heads, head_dim]`` each) into the pool; with
        ``coded``, its blocks (``-1`` in ``block_ids``) go into its pages, coded."""
        kp, vp = self.pool[self.kv_index[layer]]
        if coded is not None:
            write_pages(kp, vp, coded.pages, self.page_capacity, k[coded.blocks].flatten(0, 1),
                        v[coded.blocks].flatten(0, 1))
            keep = [i for i, b in enumerate(block_ids) if b >= 0]
            block_ids, k, v = [block_ids[i] for i in keep], k[keep], v[keep]
        table = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kp.index_copy_(0, table, k.to(device=kp.device, dtype=kp.dtype))
        vp.index_copy_(0, table, v.to(device=vp.device, dtype=vp.dtype))

    def state_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Hybrid models: (name, shape, dtype) of each tensor one sequence keeps per GDN layer; [] otherwise."""
        if self.state is None:
            return []
        s = self.state.layers[0]
        return [("conv", tuple(s.conv.shape[1:]), s.conv.dtype), ("recurrent", tuple(s.recurrent.shape[1:]),
                                                                   s.recurrent.dtype)]

    def gather_state(self, seq: Sequence, layer: int) -> dict[str, torch.Tensor]:
        """Copies of ``seq``'s state in GDN decoder layer ``layer``: ``{"conv", "recurrent"}``."""
        assert self.state is not None and seq.state_slot is not None
        conv, rec = self.state.read(self.state_index[layer], seq.state_slot)
        return {"conv": conv, "recurrent": rec}

    @torch.inference_mode()
    def write_state(self, slot: int, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """Store a received state (see :meth:`gather_state`) into ``slot``."""
        assert self.state is not None
        self.state.write(self.state_index[layer], slot, tensors["conv"], tensors["recurrent"])

    @property
    def track_routing(self) -> bool:
        """Whether steps add up each sequence's expert choices (``Sequence.expert_hist``)."""
        return any(m.record_routing for m in self._moe_layers())

    def _moe_layers(self) -> list[SparseMoe]:
        if self._moe_cache is None:  # the layers' MLP modules are fixed once loaded
            self._moe_cache = [layer.mlp for layer in self.model.text.layers if isinstance(layer.mlp, SparseMoe)]
        return self._moe_cache

    def _accumulate_routing(self, sched: SchedulerOutput) -> None:
        """Add this step's per-sequence expert choices to ``seq.expert_hist`` ([num_layers, num_experts])."""
        t = self.model.cfg.text
        spans = [(s.seq, start, s.num_tokens) for s, start in zip(sched.prefills, _starts(sched.prefills), strict=True)]
        p = sum(s.num_tokens for s in sched.prefills)
        spans += [(s.seq, p + j, 1) for j, s in enumerate(sorted(sched.decodes, key=self._slot_key))]
        for li, layer in enumerate(self.model.text.layers):
            if not isinstance(layer.mlp, SparseMoe) or layer.mlp.last_experts is None:
                continue
            experts = layer.mlp.last_experts.cpu().numpy()
            for seq, start, n in spans:
                if seq.expert_hist is None:
                    seq.expert_hist = np.zeros((t.num_layers, t.num_experts), dtype=np.int64)
                seq.expert_hist[li] += np.bincount(experts[start:start + n].ravel(), minlength=t.num_experts)

    def _slot_key(self, s: ScheduledSeq) -> int:
        return self.mirror.slot_of.get(s.seq.seq_id, 0)


def _starts(prefills: list[ScheduledSeq]) -> list[int]:
    out, pos = [], 0
    for s in prefills:
        out.append(pos)
        pos += s.num_tokens
    return out
