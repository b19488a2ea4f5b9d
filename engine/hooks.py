"""What an engine's owner plugs into it, declared once at construction: ``LLMEngine(model_dir, config,
hooks=EngineHooks(...))``. The engine hands each hook to the part that calls it (the runner, the block manager) and
nothing changes them afterwards. The defaults give a plain engine (``LLM``, a decode worker); a prefill worker sets
all of them (:class:`prefill_node.worker.PrefillWorker`).

Threading: the engine is single-threaded, and every hook runs synchronously on the thread that called into the engine
(in the worker actors, their loop thread, under the actor's lock). A hook may read the engine's state -- the runner's
``gather_layer`` / ``gather_state`` / ``captured_queries`` -- but must not add, abort or schedule requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence

KVExporter = Callable[[int, "list[Sequence]"], None]
EvictHook = Callable[[bytes], None]
FaultHook = Callable[[str, "Sequence"], None]


@dataclass(frozen=True)
class EngineHooks:
    """The engine's hooks and the switches that go with them.

    * ``kv_exporter(layer, seqs)`` -- called by the model runner (:meth:`engine.model_runner.ModelRunner.execute`,
      inside :meth:`engine.llm_engine.LLMEngine.step`) right after decoder layer ``layer`` ran, in layer order,
      during each step that computes the final chunk of some prompts; ``seqs`` are those sequences, whose KV (or, in
      a hybrid model's GDN layers, final state) for that layer is then complete in the cache. None: nothing is
      exported.
    * ``fork_choices`` -- an ``n > 1`` request's first sample also draws the other choices' first tokens. True: the
      engine forks them here into sequences sharing the prompt's blocks. False (a prefill worker): it leaves them in
      ``Sequence.pending_choices`` for the owner to hand to the decode side, which forks them.
    * ``track_routing`` -- the MoE layers record each step's expert choices and the runner adds them up per sequence
      (``Sequence.expert_hist``, a prefill worker's routing hint); no effect on a dense model, so an owner need not
      know the model's kind before loading it.
    * ``query_window`` -- > 0: while a prompt's final chunk runs, attention keeps its last ``query_window`` queries
      of each layer in ``runner.captured_queries`` (seq_id -> ``[<= query_window, heads, head_dim]``, the current
      layer's, so read it from ``kv_exporter``), for KV importance scores (:mod:`engine.kv_importance`). 0: off.
    * ``on_evict(hash)`` -- called by the block manager (:class:`engine.block_manager.BlockManager`) with the hash of
      each cached block it evicts to reuse for new KV, while blocks are allocated (scheduling in ``step``, or
      ``preallocate`` / forking on the decode side): a prefix cache's owner may tell others what it no longer holds
      (the prefill worker tells the front-end's router). None: nobody is told.
    * ``on_snapshot_drop(hash)`` -- hybrid models: called with the block hash whose GDN state snapshot the prefix
      cache dropped (its block evicted, or the least recently used snapshot giving way to a new one): a prefix hit no
      longer ends there (the prefill worker tells the front-end's router). None: nobody is told.
    * ``request_fault(stage, seq)`` -- fault injection (tests, fault drills): called for each sequence at each
      per-request stage of a step (:data:`engine.isolation.STAGES`: ``"logits"``, ``"sample"``, ``"append"``,
      ``"output"``; a prefill worker's exporter adds ``"export"``); what it raises is that request's fault, which
      ends that request only (:mod:`engine.isolation`). None (the default): never called.
    """

    kv_exporter: KVExporter | None = None
    fork_choices: bool = True
    track_routing: bool = False
    query_window: int = 0
    on_evict: EvictHook | None = None
    on_snapshot_drop: EvictHook | None = None
    request_fault: FaultHook | None = None

    def __post_init__(self) -> None:
        if self.query_window < 0:
            raise ValueError(f"query_window must be >= 0, got {self.query_window}")
