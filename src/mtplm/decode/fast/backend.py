"""StaticBackend: the compiled decode pass with a preallocated KV store; a drop-in for RaggedCache +
ragged_pass.

The store holds keys and values per layer as [S + 1, KVH, C + 1, d]: slots 0 .. S-1 belong to sequences
(the engine's slots), slot S is scratch that padded batch entries write to, so padding never touches
a live sequence; position C is never written or read (a pass's first T <= C positions are then always a
strict slice of the store, which keeps T dynamic in the graphs: fast/graphs.py). A pass is padded to a
bucket on each of its three sizes; one graph serves every T, and on a CPU every b >= 2 and Q >= 2 of a
kind of pass (fast/graphs.py; `_graph_of` names them): there Q is fed unpadded where no op pads by it and
no bucket has a graph of its own (exact_rows), as a padded row would cost what a real one does:

  b  sequences   1, 2, 4, 8, ...         padded entries: scratch slot, length 0, see themselves only
  Q  fed rows    1, 2, 4, 8, 16, 32      padded rows: written past the sequence's fed rows, never read
  T  key length  128, 256, 512, ... C    the keys a pass attends over: the longest context + Q, rounded up

and on whether any fed row holds `<mtp>` (known from the token lists, so no host sync): passes without
one run a graph without the gated adapters, which would add exactly zero there. A graph is compiled for the
store's shape: a store that grows compiles its graphs again (warm() grows it first); warm_in_background
compiles them while passes run uncompiled (fast/background.py).

Prompts longer than 32 rows run in chunks of `prefill_chunk` rows (decode/passes/chunked.py): wide uncompiled
passes with fused attention (fast/prefill.py), or the compiled buckets for a chunk that small. A decode
feed that wide (a long forced run) runs in the row buckets, as decode does.

Shapes: b sequences, Q fed rows, T key positions, D hidden, S slots, C capacity, KVH key/value heads,
d head dim.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch

from mtplm.decode.budget import Seen
from mtplm.decode.fast import fewrow, forward, gguf, graphs, greedy
from mtplm.decode.fast.architectures import sliding_window, unsupported
from mtplm.decode.fast.background import BackgroundCompile
from mtplm.decode.fast.graphs import GROUP_BATCH_ROWS, GROUP_LAYERS, GROUP_ROWS, WHOLE_PASS_ROWS
from mtplm.decode.fast.inputs import PassInputs, grow_store, pass_inputs
from mtplm.decode.fast.prefill import wide_pass
from mtplm.decode.fast.weights import FastWeights, packed_head, return_freed_memory
from mtplm.decode.passes.backends import SlotKV
from mtplm.decode.passes.chunked import PREFILL_CHUNK, run_split
from mtplm.decode.protocol import RowCost
from mtplm.errors import UserError
from mtplm.model import MTPModel, storage_bytes

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_KEYS = 128
# inductor's C++ reductions over more than this many keys take another accumulator (a guard on T): a graph
# serves key lengths up to it, a second one of the same bucket the longer ones
LONG_KEYS = 4096
# a store starts at this many positions and grows to multiples of it: graphs compile for the store's shape,
# so workloads of nearby lengths (a bench of 128 or 256 tokens, the next server start) reuse the cached ones
STORE_STEP = 1024


class StaticBackend:
    """Runs passes of up to `slots` sequences over a static KV store of `capacity` positions per slot."""

    def __init__(
        self,
        model: MTPModel,
        slots: int,
        capacity: int = STORE_STEP,
        compile: bool = True,
        fuse: bool = True,
        key_buckets: bool = True,
        regional: bool = True,
        whole_rows: int = WHOLE_PASS_ROWS,
        group_rows: int = GROUP_ROWS,
        group_batch_rows: int = GROUP_BATCH_ROWS,
        group: int = GROUP_LAYERS,
        group_cpp: bool = True,
        prepack: bool | None = None,
        quantize: bool | str = False,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        self.model, self.slots, self.compile, self.decode_rows = model, slots, compile, ROW_BUCKETS[-1]
        self.pass_cost: RowCost | None = None  # by rows, relative; pricing.py measures it
        self.seen: Seen = {}  # what each strategy's drafts were worth so far (budget.py)
        self.prefill_chunk, self.key_buckets = prefill_chunk, key_buckets
        self.weights = FastWeights(model, fuse, prepack, quantize, share=not model.hf_exact)
        forward.probe_attention()  # before any graph reads what it decides
        lm_head = model.hf.get_output_embeddings().weight.detach()  # [V, D]
        self._head = packed_head(model, lm_head, self.weights)
        # DecodeModel.argmax: exactly the head's greedy tokens, cheaper than its logits (greedy.py, gguf.py)
        mask_id = self.weights.shape.mask_id
        self.greedy_head = greedy.for_head(lm_head, self._head, mask_id) or gguf.greedy(self._head, mask_id)
        return_freed_memory()  # what packing freed (HF's weights, the fused copies' sources)
        self.window = sliding_window(model)
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [S + 1, KVH, C + 1, d]
        self.values: list[torch.Tensor] = []
        self._guarded: set[tuple] = set()  # (b, Q, T, adapters) that ran once with full guards on this store
        self._ready: set[tuple] = set()  # the graphs (_graph_of's names) compiled for this store
        self.background: BackgroundCompile | None = None  # graphs compiling on a thread of their own
        self._graphs: dict[tuple, tuple] = {}  # (b, Q, T, adapters) -> its graph's name (_graph_of)
        self._grow(capacity)
        self._unpadded = forward.rows_unpadded(self.weights.shape.head_dim, self.keys[0].dtype)
        self.compiled_buckets: dict[tuple, float] = {}  # graph name -> compile seconds
        self.compiles = 0  # graphs compiled so far (a store that grew compiles its buckets again)
        self._quiet = False  # warm() reports its compiles as one line
        self._identities: dict[tuple[int, int], torch.Tensor] = {}  # (b, Q) -> [b, Q, Q] identity
        self._step: Callable[..., torch.Tensor] = forward.decode_pass
        self._whole: Callable[..., torch.Tensor] | None = None  # the whole pass as one graph
        self.whole_rows = 0  # one-sequence buckets of up to this many plain rows: the whole-pass graph
        self._grouped: Callable[..., torch.Tensor] | None = None  # layers `group` at a time as one graph
        self.group_rows = 0  # other one-sequence buckets of up to this many rows: the grouped graphs
        self.group_batch_rows = 0  # batched plain buckets of up to this many rows a sequence: the same
        if compile:
            self._step, self._whole = graphs.compile_steps(self.weights, regional, whole_rows)
            self.whole_rows = whole_rows if self._whole is not None else 0
            # GGUF blocks trace as one op each (so their layers group too); int8 and int4 keep a graph a layer
            grouped = not self.weights.quantized or self.weights.quantized == "gguf"
            if regional and group_rows and grouped and not self.weights.embed.is_cuda:
                self._grouped = graphs.compile_grouped(self.weights, group, group_cpp)
                self.group_rows, self.group_batch_rows = group_rows, group_batch_rows

    # ---- a pass -----------------------------------------------------------------------------------
    def run(self, start: int, feeds: list, lengths: list[int]) -> torch.Tensor:
        """Slots [start, start + len(feeds)) in one pass, each feed (decode.Feed) behind its slot's cached
        lengths[i] positions. Hidden states [b, Q, D] (final norm applied); sequence i's rows are
        [i, :len(feeds[i].tokens)]; the fed rows' KV sits at lengths[i] .. of its slot afterwards."""
        width = max(len(feed.tokens) for feed in feeds)
        if width > ROW_BUCKETS[-1]:
            return self._wide(start, feeds, lengths, width)
        adapters, background = self._adapters(feeds), self.background
        rows = width if self.exact_rows(len(feeds), width, adapters) else _bucket(width)
        self._fit(max(lengths) + rows)
        bucket = (_bucket(len(feeds)), rows, self._key_length(max(lengths) + rows), adapters)
        hold = background.hold(self._graph_of(bucket)) if background else nullcontext(self.compile)
        with torch.inference_mode(), hold as graphs:  # (inference tensors in, as the graphs were traced)
            if graphs:  # a compiled graph, padded to its bucket
                hidden = self._compiled(self._inputs(start, feeds, lengths, *bucket[:2]), bucket)
            else:  # the same pass uncompiled, as wide as its feeds (bitwise the same rows)
                inputs, keys = self._inputs(start, feeds, lengths, len(feeds), width), max(lengths) + width
                hidden = forward.decode_pass(self.weights, self.keys, self.values, *inputs, keys, adapters)
        return hidden[: len(feeds), :width]

    def _adapters(self, feeds: list) -> bool:
        shape = self.weights.shape  # whether a fed row holds <mtp>, from host data: no sync
        return shape.gated and any(shape.mask_id in feed.tokens for feed in feeds)

    def _wide(self, start: int, feeds: list, lengths: list[int], width: int) -> torch.Tensor:
        """A pass with a feed wider than the row buckets (a prompt): each sequence on its own, chunk by
        chunk, a decode feed in row buckets (decode/passes/chunked.py run_split) -> hidden states
        [b, width, D], padding rows zero."""
        self._fit(max(lengths) + width + ROW_BUCKETS[-1])  # the store grows once, not once per chunk
        out = None
        for i, (feed, past) in enumerate(zip(feeds, lengths, strict=False)):
            hidden = run_split(
                feed, past, self.prefill_chunk, ROW_BUCKETS[-1], partial(self._chunk, start + i)
            )
            if out is None:
                out = hidden.new_zeros(len(feeds), width, hidden.shape[-1])
            out[i, : hidden.shape[0]] = hidden
        assert out is not None
        return out

    def _chunk(self, slot: int, feed, past: int) -> torch.Tensor:
        """One chunk of a wide pass -> [rows, D]: a compiled bucket where it fits, else a wide pass."""
        rows = len(feed.tokens)
        if rows <= ROW_BUCKETS[-1]:
            return self.run(slot, [feed], [past])[0]
        self._fit(past + rows)
        inputs = self._inputs(slot, [feed], [past], 1, rows)
        with torch.inference_mode():
            hidden = wide_pass(
                self.weights, self.keys, self.values, *inputs, past + rows, self._adapters([feed])
            )
        return hidden[0]

    # ---- warming up --------------------------------------------------------------------------------
    def warm(
        self, buckets: list[tuple[int, int, bool]], capacity: int, progress: Callable | None = None
    ) -> tuple[int, float]:
        """Compile the graph of every (b, Q, adapters) bucket of `buckets` not compiled yet (each serves every
        key length), by a pass over the scratch slot only, after growing the store to `capacity` positions
        (graphs compiled for a smaller store would compile again when it grows). `progress(done, total,
        seconds)` after each. (graphs compiled, seconds); a backend that does not compile returns (0, 0.0)."""
        self._fit(capacity)
        if not self.compile:
            return 0, 0.0
        began, todo = time.perf_counter(), self.to_compile(buckets)
        for done, bucket in enumerate(todo, 1):
            self.compile_graph(bucket)
            if progress is not None:
                progress(done, len(todo), time.perf_counter() - began)
        return len(todo), time.perf_counter() - began

    def warm_in_background(
        self, buckets: list[tuple[int, int, bool]], capacity: int, progress: Callable | None = None
    ) -> BackgroundCompile | None:
        """warm() on a thread of its own, started by the caller (`.start()`; None: nothing to compile): passes
        run uncompiled (bitwise the same rows) until their graph is ready (fast/background.py)."""
        self._fit(capacity)
        if not self.to_compile(buckets):
            return None
        self.background = BackgroundCompile(self, buckets, progress)
        return self.background

    def compile_graph(self, bucket: tuple) -> None:
        """Compile the graph of one (b, Q, adapters[, "long"]) bucket (to_compile's), quietly, by a pass over
        the scratch slot only."""
        batch, rows, adapters, *long = bucket
        keys = self._key_length(self.capacity if long else rows)
        self._quiet = True
        try:
            with torch.inference_mode():  # inference tensors, as a decode loop's: dynamo guards on it
                self._compiled(self._inputs(0, [], [], batch, rows), (batch, rows, keys, adapters))
        finally:
            self._quiet = False

    def to_compile(self, buckets: list[tuple[int, int, bool]], capacity: int = 0) -> list[tuple]:
        """The graphs of `buckets` not compiled yet for the store that holds `capacity` positions (one that
        grows compiles all again): (b, Q, adapters), and with "long" where it holds over LONG_KEYS keys."""
        size, wanted = self._grown(capacity), list[tuple](dict.fromkeys(buckets))
        wanted += [(*b, "long") for b in wanted] if size > LONG_KEYS else []
        graphs: dict[tuple, tuple] = {}  # graph -> the first bucket of `wanted` it serves
        for b, q, adapters, *long in wanted:
            graph = self._graph_of((b, q, LONG_KEYS + 1 if long else MIN_KEYS, adapters))
            if size > self.capacity or graph not in self._ready:
                graphs.setdefault(graph, (b, q, adapters, *long))
        return list(graphs.values()) if self.compile else []

    def ready(self, graph: tuple) -> bool:  # `graph` (_graph_of's name) compiled for the store as it is
        return graph in self._ready

    def _compiled(self, inputs: tuple, bucket: tuple[int, int, int, bool]) -> torch.Tensor:
        """A pass of bucket (b, Q, T, adapters) through the graph of (b, Q, adapters), compiled on its
        first call; every guard is checked on the first call of each T (a new T runs the graph only where
        its guards hold, else compiles); after it a CPU graph runs without dynamo (graphs.Graph)."""
        graph, step = self._graph_of(bucket), self._step_for(bucket)
        first = graph not in self._ready
        began = time.perf_counter()
        limit = 8 * len(ROW_BUCKETS) * 16  # graphs: every (b, Q, adapters) this backend may meet, and more
        with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=limit):
            try:
                args = (self.weights, self.keys, self.values, *inputs, *bucket[2:])
                hidden = graphs.call(step, args, bucket in self._guarded)
            except torch._dynamo.exc.BackendCompilerFailed as exc:  # e.g. the C++ compiler failed
                if not first:
                    raise
                cause = str(exc.inner_exception).strip().splitlines() or [type(exc.inner_exception).__name__]
                raise UserError(
                    f"compiling the decode pass failed ({cause[0][:200]}); fix the compiler "
                    f"(CXX, g++) or run with --backend eager"
                ) from exc
        if not self.weights.embed.is_cuda:  # CUDA graphs keep all their guards (not measured there)
            self._guarded.add(bucket)
        if first:
            self._ready.add(graph)
            self.compiles += 1
            self.compiled_buckets[graph] = seconds = time.perf_counter() - began
            if not self._quiet:
                log.info(
                    f"mtplm: compiled the decode pass for {graph[0]} sequences x {graph[1]} rows"
                    f"{' with <mtp> rows' if bucket[3] else ''} (every key length) in {seconds:.1f} s"
                )
        return hidden

    def exact_rows(self, batch: int, rows: int, adapters: bool = False) -> bool:
        """Whether a compiled pass feeds `rows` rows unpadded: on a CPU, where its graph's Q is symbolic and
        no op pads by it (_unpadded, decided in __init__: forward.rows_unpadded)."""
        if rows < 2 or not self._unpadded or self.weights.embed.is_cuda:  # a 1-row pass asks nothing more
            return False
        return self._step_for((_bucket(batch), _bucket(rows), 0, adapters)) is not self._whole

    def _step_for(self, bucket: tuple[int, int, int, bool]) -> Callable[..., torch.Tensor]:
        """The whole-pass graph for hot one-sequence plain buckets, grouped layers for the other
        one-sequence buckets of up to group_rows rows and batched plain ones of up to group_batch_rows rows a
        sequence, else a graph per layer."""
        one, rows, masks = bucket[0] == 1, bucket[1], bucket[3]
        if one and rows <= self.whole_rows and not masks and self._whole is not None:
            return self._whole
        if self._grouped is None or (masks and not one):
            return self._step
        return self._grouped if rows <= (self.group_rows if one else self.group_batch_rows) else self._step

    def _graph_of(self, bucket: tuple[int, int, int, bool]) -> tuple:
        """The graph that runs bucket (b, Q, T, adapters): (sequences, rows, adapters[, "long"]), where a
        CPU graph's sequences and rows over 1 are symbolic (graphs.symbolic_sizes), so they read as the
        range the graph serves ("2-32"): on a GPU, or in the whole pass, each bucket has its own graph."""
        if bucket not in self._graphs:  # named once per bucket: every compiled pass asks
            self._graphs[bucket] = self._name_graph(bucket)
        return self._graphs[bucket]

    def _name_graph(self, bucket: tuple[int, int, int, bool]) -> tuple:
        b, q, keys, adapters = bucket
        long = ("long",) if keys > LONG_KEYS else ()
        step = self._step_for(bucket)
        if self.weights.embed.is_cuda or step is self._whole:
            return (b, q, adapters, *long)
        one = b == 1
        grouped_rows = self.group_rows if one else self.group_batch_rows
        if step is self._grouped:
            low, high = (self.whole_rows + 1 if one and not adapters else 2), grouped_rows
        else:  # a graph per layer: the rows the grouped graphs leave it
            low = 2 if self._grouped is None or (adapters and not one) else grouped_rows + 1
            high = ROW_BUCKETS[-1]
        rows: int | str = 1 if q == 1 else f"{max(2, low)}-{high}"
        return (1 if one else f"2-{_bucket(self.slots)}", rows, adapters, *long)

    def _inputs(self, start: int, feeds: list, lengths: list[int], batch: int, rows: int) -> PassInputs:
        return pass_inputs(start, feeds, lengths, batch, rows, self.slots, self._identities, self.weights)

    def _key_length(self, needed: int) -> int:
        if not self.key_buckets:
            return self.capacity
        return min(self.capacity, max(MIN_KEYS, 1 << (needed - 1).bit_length()))

    # ---- the store --------------------------------------------------------------------------------
    def _fit(self, needed: int) -> None:
        if needed > self.capacity:
            with self.background.lock if self.background else nullcontext():  # not under a compiling graph
                self._grow(self._grown(needed))

    def _grown(self, needed: int) -> int:
        """The capacity once the store holds `needed`: it grows 2x or more, to a multiple of STORE_STEP, but
        never past a sliding window that `needed` fits in (_grow refuses a store longer than the window)."""
        if needed <= self.capacity:
            return self.capacity
        size = -(-max(needed, 2 * self.capacity) // STORE_STEP) * STORE_STEP
        return min(size, self.window) if self.window is not None and needed <= self.window else size

    def _grow(self, capacity: int) -> None:
        """A larger store (compiled buckets for the old one recompile once: the store's shape changed)."""
        if self.window is not None and capacity > self.window:
            raise UserError(
                f"the compiled backend does not implement sliding-window attention; this model's "
                f"window is {self.window} positions and a sequence needs {capacity}: use --backend eager"
            )
        self._guarded.clear()  # the store's shape changes: every bucket's next call checks all its guards
        self._ready.clear()  # ... and compiles its graph again
        shape = self.weights.shape
        size = (self.slots + 1, shape.kv_heads, capacity + 1, shape.head_dim)  # + 1: never attended
        grow_store([self.keys, self.values], shape.layers, size, self.capacity, self.weights.embed)
        self.capacity = capacity

    def kv(self, slot: int) -> SlotKV:
        return SlotKV(self, slot)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [..., V] in float32, over prepacked weights where the decoder's are prepacked."""
        if self._head is None:
            return self.model.head(hidden)
        logits = gguf.head_logits(hidden, self._head).float()  # packed, or the GGUF's quantized head
        if self.weights.shape.mask_id >= 0:
            logits[..., self.weights.shape.mask_id] = float("-inf")
        return logits

    @property
    def row_dependence(self) -> str | None:
        """None where every product and attention sum has one order per row (mtplm's own kernels, or
        float32); else what rounds by the rows a pass feeds. On a GPU: not checked (None)."""
        if self.model.hf.dtype == torch.float32 or self.weights.embed.is_cuda:
            return None
        if self.weights.quantized == "int8":
            return "PyTorch's int8 weight kernel rounds by the rows a pass feeds"
        if not fewrow.load():
            why = fewrow.unavailable() or "its build failed"
            return f"oneDNN's bf16 products round by the rows a pass feeds (mtplm's own kernels: {why})"
        return None

    @property
    def kernel_isa(self) -> str:
        """Which products its passes run: the few-row kernels' ISA ("amx", "avx512", "avx2"), or "onednn"."""
        return fewrow.isa() if fewrow.load() else "onednn"

    unsupported = staticmethod(unsupported)  # why this backend cannot run a model (None: it can)

    def move(self, source: int, target: int, length: int) -> None:
        """Copy slot `source`'s first `length` positions into slot `target` (compaction)."""
        for store in self.keys + self.values:
            store[target, :, :length] = store[source, :, :length]

    def keep_rows(self, slot: int, start: int, rows: list[int]) -> None:
        """Move positions start + rows[i] of a slot to start + i (a kept tree path)."""
        index = torch.tensor([start + r for r in rows], dtype=torch.long, device=self.weights.embed.device)
        for store in self.keys + self.values:
            store[slot, :, start : start + len(rows)] = store[slot, :, index]

    def nbytes(self) -> int:
        """Bytes it holds beside the model's own tensors: the KV store (scratch slot included) and the weight
        copies it does not share with the model (fused, packed, int8 greedy head)."""
        held = [*self.keys, *self.values, *gguf.held(self.weights, self._head)]
        held += greedy.copies(self.greedy_head)
        return storage_bytes(held, exclude=self.model.tensors())


def _bucket(size: int) -> int:
    return 1 << (size - 1).bit_length()
