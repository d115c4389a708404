"""How the compiled backend (fast/backend.py) compiles its pass: which functions become graphs, with which
inductor options, where the compile cache lives, and how much of dynamo's guard checking a call pays.

Measured choices (docs/backends-kernels.md, SmolLM2-135M bf16 on a 2-vCPU Xeon with AMX):
  - one graph per bucket for a layer, shared by all layers (`regional`): ~2 s cold compile a bucket, but 30
    graph calls a pass (~3-5 ms of a ~23 ms 1-row pass in guards, wrappers and per-call Python);
  - the whole pass as one graph: 18.6 against 24.2 ms a 1-row pass, but 37-61 s a cold compile a bucket
    (3-5 s per layer graph), so only the hot one-sequence decode buckets take it (WHOLE_PASS_ROWS
    below); it loads in ~3.5 s from a warm cache;
  - other one-sequence buckets of up to GROUP_ROWS rows, with or without <mtp> rows: GROUP_LAYERS (15)
    layers a graph (`compile_grouped`, 2 calls a pass). A graph call costs ~0.2-0.4 ms of dynamo and wrapper
    time whatever its size, so (paired runs, Xeon with AMX): 6 layers a graph 17.1 / 18.1 ms for 8
    plain / 1 + 7 <mtp> rows, 15 layers 16.4 / 17.3, the whole pass ~0.7 ms under that again but 60-105 s a
    cold compile a bucket against 20-34 s (6 layers: 8-22 s); a graph per layer is slower still;
  - on a CPU, inductor's C++ wrapper (`cpp_wrapper`) calls the kernels with no Python between them, in the
    layer graphs and the whole-pass graph alike: the whole 1-row pass 12.1 -> 10.7 ms (the Python wrapper's
    ~360 kernel and op calls a pass). Its entry function is built apart from the kernels, at -O1
    (`cpp_wrapper_build_separate`): built as one -O3 file with them, g++ alone took most of a cold compile
    (AVX2-only AMD EPYC: the bf16 whole pass 147 s against 51 s, a 15-layer graph with <mtp> adapters 153
    against 66 s), and passes ran alike either way (11.45 / 11.37 ms a 1-row pass, interleaved);
  - after a bucket's first call (every guard checked), no dynamo at all on a CPU: each compiled function is
    a `Graph`, which calls the graph dynamo found for the same argument signature as a plain function
    (through dynamo, even with only the graph-telling guards of `guards`, still the fallback, SmolLM2-135M's
    Q4_1 pass on the AMD EPYC took 11.3 against 9.7 ms at 1 row, 21.9 against 20.1 at 8: docs/backends.md);
  - bf16 rounded where eager rounds (`emulate_precision_casts`): a fused graph otherwise keeps a bf16 op's
    fp32 result unrounded for the ops fused after it, so the whole-pass graph (1 row) and the per-layer
    graphs (k rows) round a row differently, and lossless verified decoding then loses plain decoding's
    exact tokens at near-ties (tests/decode/test_invariance.py);
  - one graph serves every key length T: T reaches a graph as a dynamic size (the mask's last dimension,
    or `key_span` for the whole pass, marked with mark_dynamic). Inductor's C++ reductions guard on
    T <= 4096 (a longer one takes another accumulator), so a graph has a second one for longer key lengths
    (backend.LONG_KEYS). The store holds one position past the largest key length (backend.py), so
    slicing its first T positions is never the whole store, which would specialize T;
  - on a CPU, one layer graph serves every b >= 2 and every Q >= 2 too (`symbolic_sizes`; dynamo
    specializes a size of 1, so 1 stays its own graph): SmolLM2-135M on the AMD EPYC, 2 to 32 rows, one
    cold compile of ~40 s against 24-34 s for each row bucket, passes as fast within the run-to-run noise
    (+-15 %), rows bitwise the same. The few-row kernels take their sizes at run time, so a symbolic size
    only reaches the elementwise loops. The whole pass stays one graph per bucket (1 x 1 by default).

Inductor's compile cache lives under `$MTPLM_HOME/inductor` (unless TORCHINDUCTOR_CACHE_DIR is set), so a
second process reuses the generated kernels instead of recompiling them; inductor writes its cache entries
atomically.
"""

from __future__ import annotations

import inspect
import logging
import os
import types
from collections.abc import Callable
from contextlib import nullcontext
from contextvars import ContextVar
from functools import partial
from typing import Any

import torch

from mtplm.decode.fast.forward import attention_mask, decode_pass, layer, prepare, rms_norm
from mtplm.decode.fast.weights import FastWeights

log = logging.getLogger(__name__)

# every graph rounds bf16 where eager does: a row's logits are then the same bitwise in every bucket
ROUNDED: dict[str, Any] = {"emulate_precision_casts": True}
# a graph with inductor's C++ wrapper: its entry function compiled apart from the kernels, at -O1
CPP_WRAPPER: dict[str, Any] = {**ROUNDED, "cpp_wrapper": True, "cpp_wrapper_build_separate": True}

# one-sequence buckets of up to this many rows and no <mtp> row compile the whole pass as one graph (plain
# decoding's bucket): measured 18.6 against 24.2 ms a 1-row pass, but 51 s a cold compile with its C++
# wrapper (bf16, AVX2-only EPYC) against 3-5 s a layer graph (docs/backends-kernels.md). Not over GGUF
# blocks: there a 1-row pass takes the grouped graphs (2 calls with the C++ wrapper), SmolLM2's Q4_1 on an
# AVX2-only AMD EPYC 9.41 ms a pass and 38.5 s a cold compile, against the whole pass's 10.66 ms and 53 s
# with the Python wrapper and 8.75 ms and 74 s with the C++ one (interleaved, rows bitwise alike)
WHOLE_PASS_ROWS = 1
# other one-sequence buckets of up to this many rows (verified and mask-slot modes: quadratic drafting feeds
# 16-32) run GROUP_LAYERS layers a graph (compile_grouped): each graph call costs ~0.2-0.4 ms of dynamo and
# wrapper time, so 15 layers (2 calls a pass) beat 6 (5 calls) by 0.7-1.0 ms a pass at 8-16 rows, for a
# cold compile of 20-34 s a bucket against 8-22 s (docs/backends-kernels.md)
GROUP_ROWS = 32
GROUP_LAYERS = 15
# batched buckets without <mtp> rows of up to this many rows a sequence (the server's plain and
# verified:lookup passes) take the grouped graphs too: 8 x 1 rows 20.0 against 24.2 ms a graph per layer,
# 2 x 8 18.4 against 22.0, for ~19 s a cold compile against 3-5; wider and <mtp> batched buckets keep a
# graph per layer
GROUP_BATCH_ROWS = 8


def compile_steps(
    weights: FastWeights, regional: bool, whole_rows: int
) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor] | None]:
    """(the pass for every bucket, the whole-pass graph for the hot buckets or None), both called like
    decode_pass. `regional`: one graph per bucket for a layer, called once per layer; else the whole pass
    as one graph for every bucket. On a CPU with `whole_rows`, the regional pass comes with a whole-pass
    graph for one-sequence buckets of up to that many rows (not over a GGUF's blocks: WHOLE_PASS_ROWS)."""
    _use_mtplm_compile_cache()
    on_gpu = weights.embed.is_cuda
    # on a GPU, CUDA graphs replay each bucket's kernels without launch overhead (the store is static)
    mode = "reduce-overhead" if on_gpu else None
    # (torch.compile takes a mode or options, not both: on a GPU its graphs keep inductor's own rounding)
    options = None if mode else ROUNDED
    # on a CPU, Graphs: a call whose guards are known runs its graph without dynamo (Graph)
    compile_fn: Callable[..., Callable[..., torch.Tensor]] = torch.compile if on_gpu else Graph
    compiled = partial(compile_fn, dynamic=False, fullgraph=True, mode=mode, options=options)
    if not regional:
        return _spanned(compiled(whole_pass)), None
    python_wrapper = on_gpu or weights.quantized  # CUDA graphs; quantized: not measured
    cpp = {} if python_wrapper else {"options": CPP_WRAPPER}
    if on_gpu:  # CUDA graphs: one per bucket, each layer's output copied out
        step = compiled(masked_layer)
        regional_pass = partial(decode_pass, step=_keyless(_copied(step)), masking=dynamic_mask)
    else:  # a graph of one layer, shared by every layer, its b and Q symbolic where over 1
        regional_pass = partial(grouped_pass, compiled(layers, **cpp), weights.shape.layers)
    if not whole_rows or on_gpu or weights.quantized == "gguf":  # GGUF: see WHOLE_PASS_ROWS
        return regional_pass, None
    # the whole pass's C++ wrapper: 1-row pass 12.1 -> 10.7 ms (its cold compile: the module docstring)
    return regional_pass, _spanned(compiled(whole_pass, **cpp))


def dynamic_mask(lengths: torch.Tensor, allowed: torch.Tensor, kv_len: int) -> torch.Tensor:
    """attention_mask [b, 1, 1, Q, T] with its T marked dynamic: the layer graphs it feeds take their key
    length from it, so one graph serves every T."""
    mask = attention_mask(lengths, allowed, kv_len)
    torch._dynamo.mark_dynamic(mask, 4)
    return mask


def key_span(kv_len: int, device: torch.device) -> torch.Tensor:
    """A [T] tensor whose only use is its size, marked dynamic: how the whole-pass graph learns T (an int
    argument would be specialized, one graph per T). One per (T, device), kept."""
    found = _SPANS.get((kv_len, device))
    if found is None:
        found = _SPANS[(kv_len, device)] = torch.empty(kv_len, dtype=torch.uint8, device=device)
        torch._dynamo.mark_dynamic(found, 0)
    return found


_SPANS: dict[tuple[int, torch.device], torch.Tensor] = {}


def whole_pass(weights, keys, values, ids, positions, lengths, allowed, slots, span, adapters=True):
    """decode_pass over span.shape[0] key positions (the graph compiled for every bucket's whole pass)."""
    keys_read = span.shape[0]
    return decode_pass(weights, keys, values, ids, positions, lengths, allowed, slots, keys_read, adapters)


def masked_layer(block, shape, hidden, rope, mask, gate, store, slots, write) -> torch.Tensor:
    """`layer` over mask.shape[-1] key positions (the per-layer graph)."""
    return layer(block, shape, hidden, rope, mask, gate, store, slots, write, mask.shape[-1])


def _spanned(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A compiled whole_pass called like decode_pass (kv_len an int)."""

    def run(weights, keys, values, ids, positions, lengths, allowed, slots, kv_len, adapters=True):
        span = key_span(kv_len, ids.device)
        return step(weights, keys, values, ids, positions, lengths, allowed, slots, span, adapters)

    return run


def _keyless(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A compiled masked_layer called like `layer` (its kv_len, an int, dropped: the mask carries T)."""
    return lambda *args: step(*args[:-1])


def compile_grouped(weights: FastWeights, size: int, cpp_wrapper: bool) -> Callable[..., torch.Tensor]:
    """A pass called like decode_pass whose layers run `size` at a time as one graph (`layers`, shared by
    every group of the pass: same shapes, the blocks' tensors are graph inputs), so a pass makes
    layers / size graph calls instead of one per layer. CPU only."""
    options = CPP_WRAPPER if cpp_wrapper else ROUNDED
    step = Graph(layers, dynamic=False, fullgraph=True, options=options)  # T: the mask's size
    groups = -(-weights.shape.layers // max(1, size))
    return partial(grouped_pass, step, groups)


def layers(blocks: tuple, shape, hidden, rope, mask, gate, stores: tuple, slots, write) -> torch.Tensor:
    """Consecutive decoder layers (`layer` each, over mask.shape[-1] key positions), hidden [b, Q, D] in and
    out; stores: (keys, values) each."""
    for block, store in zip(blocks, stores, strict=True):
        hidden = layer(block, shape, hidden, rope, mask, gate, store, slots, write, mask.shape[-1])
    return hidden


def grouped_pass(
    step: Callable[..., torch.Tensor],
    groups: int,
    weights: FastWeights,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    ids: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    allowed: torch.Tensor,
    slots: torch.Tensor,
    kv_len: int,
    adapters: bool = True,
) -> torch.Tensor:
    """decode_pass with the layers split into `groups` runs of consecutive layers (sizes differing by at most
    one: at most two graphs), each one call of `step` (`layers`)."""
    shape = weights.shape
    hidden, rope, mask, gate, write = prepare(
        weights, ids, positions, lengths, allowed, kv_len, adapters, dynamic_mask
    )
    hidden, rope, mask, gate, write = symbolic_sizes(hidden, rope, mask, gate, write, slots)
    blocks, stores = list(weights.blocks), list(zip(keys, values, strict=True))
    bounds = [shape.layers * g // groups for g in range(groups + 1)]
    for first, end in zip(bounds, bounds[1:], strict=False):
        run = (tuple(blocks[first:end]), shape, hidden, rope, mask, gate, tuple(stores[first:end]))
        hidden = step(*run, slots, write)
    return rms_norm(hidden, weights.final_norm, shape.eps)


def symbolic_sizes(hidden, rope, mask, gate, write, slots) -> tuple:
    """prepare()'s tensors and `slots` with the sequences b and the fed rows Q marked dynamic where over 1
    (dynamo specializes a size of 1): one graph serves every b >= 2 and every Q >= 2, so a workload
    compiles one graph where it compiled one per bucket (cold: ~40 s against 24-34 s each, same speed
    and bitwise the same rows, docs/backends.md)."""
    b, q = hidden.shape[:2]
    marks = [(hidden, 1), (rope[0], 1), (rope[1], 1), (mask, 3), (write, 1), (gate, 1)] if q > 1 else []
    marks += [(hidden, 0), (rope[0], 0), (rope[1], 0), (mask, 0), (write, 0), (gate, 0)] if b > 1 else []
    marks += [(slots, 0)] if b > 1 else []
    for tensor, dim in marks:
        if tensor is not None:
            torch._dynamo.mark_dynamic(tensor, dim)
    return hidden, rope, mask, gate, write


def _copied(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A per-layer CUDA graph writes every replay into the same output buffer: the next layer's replay would
    overwrite the input it reads, so each layer's output is copied out first."""
    return lambda *args: step(*args).clone()


class Graph:
    """torch.compile(fn, **options), called like fn, whose calls skip dynamo once their guards are known.

    Dynamo's own share of a compiled call (its frame hook, the cache lookup with the guards that tell a
    function's graphs apart, compile_wrapper's Python) cost 0.6-1.6 ms a call on the AMD EPYC, even with
    most guards skipped (docs/backends.md). After a call that passed all of dynamo's guards, the cached
    graph that passes them for those arguments is kept by the arguments' signature (_signature: every
    tensor's shape and dtype, every other argument's identity, the thread count and grad mode), and a later
    call with the same signature, in a pass the backend trusts (`call` with checked True: the bucket's
    first call on this store checked every guard), runs that graph's code as a plain function: dynamo's
    transformed bytecode, which reads the graph's inputs out of the arguments and calls the compiled graph.
    Nothing a graph guards on can change without changing the signature within one backend: the weights,
    the Shape and the store are fixed until the store grows (a new shape), and a pass's own tensors are
    built to its bucket's shapes. Where no cached graph passes every guard, the call goes through dynamo
    (`_cheaply_guarded`)."""

    def __init__(self, fn: Callable[..., torch.Tensor], **options: Any) -> None:
        self.fn = fn
        self.compiled = torch.compile(fn, **options)
        self.direct: dict[tuple, Callable[..., torch.Tensor] | None] = {}  # signature -> the graph's code

    def __call__(self, *args: Any) -> torch.Tensor:
        if not _TRUSTED.get():  # every guard checked: the graph found (or compiled) is kept
            hidden = self.compiled(*args)
            self._keep(args)
            return hidden
        run = self.direct.get(_signature(args), _UNKNOWN)
        if run is _UNKNOWN:
            hidden = _cheaply_guarded(self.compiled, args)
            self._keep(args)
            return hidden
        return _cheaply_guarded(self.compiled, args) if run is None else run(*args)

    def _keep(self, args: tuple) -> None:
        """Keep, for args' signature, the code of the cached graph that passes every guard for args (the one
        dynamo runs for them), or None where none does."""
        key = _signature(args)
        if key in self.direct:
            return
        self.direct[key] = None
        scope = inspect.signature(self.fn).bind(*args).arguments
        for entry in _cache_entries(self.fn.__code__):
            if entry.guard_manager.check(scope):
                fn = self.fn
                self.direct[key] = types.FunctionType(
                    entry.code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
                )
                return


_TRUSTED: ContextVar[bool] = ContextVar("mtplm_graphs_trusted", default=False)
_UNKNOWN: Any = object()


def _signature(args: tuple) -> tuple:
    """What tells a Graph's calls apart here: each argument's shape and dtype (a tensor), length and first
    item's signature (a tuple or list), value (None, bool, int) or identity (any other object), the thread
    count and grad mode (dynamo guards on both)."""
    mode = torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.get_num_threads()
    return (*map(_part, args), mode)


def _part(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.shape, arg.dtype
    if isinstance(arg, tuple | list):
        return len(arg), _part(arg[0]) if arg else None
    if arg is None or isinstance(arg, bool | int):
        return arg
    return id(arg)


def _cache_entries(code: types.CodeType) -> list:
    """Dynamo's cached graphs of `code`, most recently used first."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return _debug_get_cache_entry_list(code)


def guards(checked: bool):
    """Dynamo's guards for a compiled call: all of them until a bucket's graph ran once on this store, then
    only those that tell its cached graphs apart (torch.compiler.set_stance skip_guard_eval_unsafe; ~40 us
    a layer call otherwise). Safe here because nothing else a bucket's graph guards on changes between
    passes: the weights, the Shape and the store's shapes are fixed until the store grows (which checks
    every guard again), and a pass's own tensors are built to the bucket's shapes."""
    if not checked:
        return nullcontext()
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


_NO_GRAPH_MATCHED = "Recompilation triggered with skip_guard_eval_unsafe stance"


def call(step: Callable[..., torch.Tensor], args: tuple, checked: bool) -> torch.Tensor:
    """step(*args), its Graphs trusting their kept graphs where `checked` (the bucket's first call on this
    store checked every guard); other compiled calls under guards(checked)."""
    token = _TRUSTED.set(checked)
    try:
        return step(*args)
    finally:
        _TRUSTED.reset(token)


def _cheaply_guarded(step: Callable[..., torch.Tensor], args: tuple) -> torch.Tensor:
    """step(*args) under guards(True). Where the cheap guards match none of a function's cached graphs,
    dynamo raises before running it (seen after a background compile, whose graphs dynamo cached from
    another thread: fast/background.py): the call runs again under all its guards, which find the graph
    (or compile it)."""
    try:
        with guards(True):
            return step(*args)
    except RuntimeError as exc:
        if _NO_GRAPH_MATCHED not in str(exc):
            raise
        log.debug("mtplm: no cached graph matched the cheap guards; the call runs under all its guards")
    return step(*args)


def _use_mtplm_compile_cache() -> None:
    """Point inductor's cache at $MTPLM_HOME/inductor unless the user chose a directory. Inductor fills in
    its own default (a temp dir) the first time anything asks, so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from torch._inductor.utils import clear_caches

    from mtplm.files import home

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(home() / "inductor")
        clear_caches()
