"""What `qfuse serve` starts with where its flags leave it open: how many KV cache slots
(--max-batch) and whether the decode step replays CUDA graphs (--cuda-graph), and why.

Slots: the KV cache is allocated whole at start (slots x the context's tokens), so the
slot count is what the memory left after loading the model holds. Without --max-batch
the server takes the most slots, up to AUTO_MAX_BATCH with CUDA (CPU_MAX_BATCH on a
CPU), whose KV cache and activations fit in MEMORY_FRACTION of the free memory. An
explicit --max-batch is taken as it is, or refused in one line, before any request,
when it needs more than the free memory. CUDA graphs: on where the model is on CUDA,
off on a CPU (they need CUDA), unless --cuda-graph / --no-cuda-graph says otherwise.

With a paged KV cache (--kv-page-size) memory follows the tokens in use and the pages,
not the slots, decide admission: slots default to the most rows the decode step batches
well (AUTO_MAX_BATCH with CUDA, CPU_MAX_BATCH on a CPU; fewer only where the free memory
cannot hold their activations, sliding-window pages and one sequence of the context),
and without --kv-pages the full-attention pages take what MEMORY_FRACTION of the free
memory leaves after those (on a CPU, whose memory is the machine's, at most every slot
at the context). An explicit --kv-pages that needs more than the free memory is refused
in one line.

`plan` makes the choice; `Plan.line()` is the start-up line that says it, and
`Plan.as_dict()` what /health reports.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    import torch
# torch is imported where it is used: `qfuse serve --help` reads the figures below.

# The fast tier's 4-bit products run 1..32 rows in the row-invariant fragment kernel
# (33-256 on Hopper in the wgmma kernel, another order of sums), and 32 slots is the
# load bench/NOTES.md measures ("Serving"); more slots are an explicit --max-batch.
AUTO_MAX_BATCH = 32
CPU_MAX_BATCH = 8  # on a CPU: the default from before slots were sized by memory
# The rest of the free memory is headroom for what the estimate leaves out: the
# allocator's fragmentation, kernels' workspaces, prefill attention masks.
MEMORY_FRACTION = 0.9


def free_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of the memory a cache on ``device`` would take, None where
    unknown. On CUDA, the blocks torch's allocator holds unused count as free (the cache
    would get them)."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total
    try:  # Linux: MemAvailable counts the page cache the kernel would give back
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, OSError, ValueError):
        return None


def activation_bytes(config, dtype: torch.dtype, prefill_tokens: int, decode_rows: int,
                     cached_tokens: int = 0) -> int:
    """An estimate of what the model's calls hold beyond weights and the KV cache: one
    prefill of ``prefill_tokens`` padded tokens (a batch of prompts or one chunk of a
    long one) and decode steps over ``decode_rows`` rows in all (each CUDA graph keeps
    its own buffers; eager steps reuse theirs). The layers run one after another, so one
    layer's tensors are live at a time. Logits: a decode row's, and a prefilled prompt's
    at its last token only (`Decoder.forward(logits="last")`; a batch holds at most
    decode_rows prompts). ``cached_tokens``: a chunk's keys and values read back from
    the cache (dequantized and joined to the chunk's own, one layer at a time)."""
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    per_token = (3 * config.intermediate_size  # gate, up and act(gate) * up
                 + 2 * qkv + config.num_attention_heads * config.head_dim  # q/k/v, roped, out
                 + 6 * config.hidden_size)  # the residual, norms, o_proj and MLP outputs
    logits = 2 * config.vocab_size * 2 * decode_rows  # and one copy (soft-cap, sampling)
    cached = 4 * cached_tokens * config.num_key_value_heads * config.head_dim  # K, V; + cat
    return ((prefill_tokens + decode_rows) * per_token + logits + cached) * dtype.itemsize


def prefill_tokens(context: int, max_prefill_tokens: int, prefill_chunk: int) -> int:
    """The most tokens one prefill call holds: a chunk, or a batch of prompts up to
    max_prefill_tokens (a prompt longer than both goes alone, in chunks); without
    chunking (0) a whole prompt of the context."""
    if prefill_chunk == 0:
        return context
    return min(context, max(max_prefill_tokens, prefill_chunk))


@dataclass(frozen=True)
class Plan:
    """The slots and CUDA graphs a server starts with, and the figures behind them."""
    slots: int
    slots_reason: str  # "auto", "auto, capped", "--max-batch"
    context: int  # tokens per slot
    kv_cache_bytes: int
    activation_bytes: int  # estimated (`activation_bytes`)
    free_bytes: int | None  # after loading the model; None: unknown
    total_bytes: int | None
    cuda_graph: bool
    cuda_graph_reason: str  # "default", "--cuda-graph", "--no-cuda-graph"
    device: str
    # A paged cache (None: slotted): pages of kv_page_size tokens per full-attention
    # layer, and why ("auto": what the free memory holds; "auto, capped": every slot at
    # the context; "--kv-pages"). kv_cache_bytes then counts every pool, sliding too.
    kv_page_size: int | None = None
    kv_pages: int | None = None
    kv_pages_reason: str | None = None

    def line(self) -> str:
        """One line: the slots and why, the KV cache's memory, CUDA graphs and why."""
        if self.kv_page_size is not None:
            return self._paged_line()
        kv = f"KV cache {gib(self.kv_cache_bytes)}"
        if self.free_bytes is not None:
            kv += f" of {gib(self.free_bytes)} free"
        if self.slots_reason == "--max-batch":
            why = f"--max-batch; {kv}"
        elif self.slots_reason == "auto, capped":
            where = "with CUDA" if self.device.startswith("cuda") else "on a CPU"
            why = f"{kv}; {self.slots} at most by default {where}; --max-batch N to change"
        else:
            why = (f"as many as fit in {MEMORY_FRACTION:.0%} of the free memory: {kv}; "
                   "--max-batch N to change")
        return f"qfuse serve: slots {self.slots} ({why}), CUDA graphs {self._graphs()}"

    def _paged_line(self) -> str:
        where = "with CUDA" if self.device.startswith("cuda") else "on a CPU"
        if self.slots_reason == "--max-batch":
            slots = "--max-batch"
        elif self.slots_reason == "auto, capped":
            slots = f"at most by default {where}; --max-batch N to change"
        else:
            slots = "as many as the free memory holds; --max-batch N to change"
        memory = gib(self.kv_cache_bytes)
        if self.free_bytes is not None:
            memory += f" of {gib(self.free_bytes)} free"
        if self.kv_pages_reason == "--kv-pages":
            pages = f"{memory}; --kv-pages"
        elif self.kv_pages_reason == "auto":
            pages = (f"{memory}: as many as fit in {MEMORY_FRACTION:.0%} of it; "
                     "--kv-pages N to change")
        else:
            pages = f"{memory}: every slot at {self.context} tokens; --kv-pages N to change"
        return (f"qfuse serve: slots {self.slots} ({slots}; the pages decide admission), "
                f"KV pages {self.kv_pages} x {self.kv_page_size} tokens ({pages}), "
                f"CUDA graphs {self._graphs()}")

    def _graphs(self) -> str:
        graphs = "on" if self.cuda_graph else "off"
        if self.cuda_graph_reason == "default":
            graphs += " (--no-cuda-graph to decode eagerly)" if self.cuda_graph \
                else " (they need CUDA)"
        else:
            graphs += f" ({self.cuda_graph_reason})"
        return graphs

    def as_dict(self) -> dict:
        return {**asdict(self), "memory_fraction": MEMORY_FRACTION, "summary": self.line()}


def gib(n: int) -> str:
    """Bytes for people: GiB, or MiB below one GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def plan(model, *, max_batch: int | None, context: int | None, kv_bits: int,
         kv_group_size: int, cuda_graph: bool | None, deterministic: bool,
         max_prefill_tokens: int, prefill_chunk: int = 512, kv_page_size: int | None = None,
         kv_pages: int | None = None, prefix_caching: bool = False,
         mixed_steps: bool = False) -> Plan:
    """The slots, KV pages and CUDA graphs for serving ``model`` (loaded: its weights are
    off the free memory; a Decoder, or anything with its ``config``, ``dtype`` and
    ``model.norm.weight``) under these flags (None: not given; ``kv_page_size``: a paged
    cache; ``prefix_caching``: its prefix cache is
    on, which sizes the sliding-window pools as the engine does, as ``mixed_steps``
    does). UserError when the slots or pages asked for, or a single slot by default,
    need more than the free memory."""
    from ..runtime.cache import kv_cache_bytes
    from ..runtime.generation import default_cuda_graph
    from .buckets import paged_cache_options, step_buckets

    cfg, dtype = model.config, model.dtype
    device = model.model.norm.weight.device
    on_cuda = device.type == "cuda"
    context = min(context or cfg.max_position_embeddings, cfg.max_position_embeddings)
    paged = kv_page_size is not None
    graphed = default_cuda_graph(device) if cuda_graph is None else cuda_graph
    graph_reason = "default" if cuda_graph is None else \
        ("--cuda-graph" if cuda_graph else "--no-cuda-graph")

    def activations(slots: int) -> int:
        buckets = step_buckets(model, slots, deterministic)
        rows = sum(buckets) if graphed else max(buckets)
        tokens = prefill_tokens(context, max_prefill_tokens, prefill_chunk)
        return activation_bytes(cfg, dtype, tokens, rows, context if prefill_chunk else 0)

    def needs(slots: int) -> tuple[int, int]:
        return (kv_cache_bytes(cfg, slots, context, dtype, kv_bits, kv_group_size),
                activations(slots))

    memory = free_memory(device)
    free, total = memory if memory is not None else (None, None)
    if paged:
        cache = paged_cache_options(context, prefill_chunk, prefix_caching,
                                    graphed or deterministic, mixed_steps)
        return _plan_pages(model, activations, free, total, max_batch=max_batch,
                           context=context, kv_bits=kv_bits, kv_group_size=kv_group_size,
                           kv_page_size=kv_page_size, kv_pages=kv_pages,
                           chunk=cache["chunk_tokens"], scratch=cache["scratch_page"],
                           cuda_graph=graphed,
                           graph_reason=graph_reason)
    if max_batch is not None:
        slots, reason = max_batch, "--max-batch"
        kv, act = needs(slots)
        if free is not None and kv + act > free:
            fit = _most(needs, free, max_batch - 1)
            raise UserError(
                f"--max-batch {max_batch}: a KV cache of {max_batch} slots x {context} "
                f"tokens needs {gib(kv)} (and about {gib(act)} for activations), but "
                f"{gib(free)} of {'GPU ' if on_cuda else ''}memory is free; "
                + (f"at most {fit} slots fit, or " if fit else "")
                + "lower --max-kv-size" + ("" if kv_bits == 4 else " or pass --kv-bits 4"))
    else:
        cap = AUTO_MAX_BATCH if on_cuda else CPU_MAX_BATCH
        budget = None if free is None else int(MEMORY_FRACTION * free)
        slots = cap if budget is None else _most(needs, budget, cap)
        if slots == 0:
            kv, act = needs(1)
            raise UserError(
                f"one KV cache slot of {context} tokens needs {gib(kv)} (and about "
                f"{gib(act)} for activations), over {MEMORY_FRACTION:.0%} of the "
                f"{gib(free)} of {'GPU ' if on_cuda else ''}memory free; lower "
                "--max-kv-size" + ("" if kv_bits == 4 else " or pass --kv-bits 4"))
        reason = "auto, capped" if slots == cap else "auto"
        kv, act = needs(slots)
    return Plan(slots, reason, context, kv, act, free, total, graphed, graph_reason,
                str(device))


def _plan_pages(model, activations, free: int | None, total: int | None, *,
                max_batch: int | None, context: int, kv_bits: int, kv_group_size: int,
                kv_page_size: int, kv_pages: int | None, chunk: int, scratch: bool,
                cuda_graph: bool, graph_reason: str) -> Plan:
    """`plan` with a paged cache (its module docstring): ``activations(slots)``, bytes;
    ``chunk`` and ``scratch``, the engine's chunk_tokens and scratch_page."""
    from ..runtime.paged_cache import layer_windows, page_bytes, paged_kv_cache_bytes

    cfg, dtype = model.config, model.dtype
    device = model.model.norm.weight.device
    on_cuda = device.type == "cuda"
    per_seq = -(-context // kv_page_size)
    full_layers = layer_windows(cfg, context).count(None)
    # One more full-attention page costs one page in each full layer's pool.
    per_page = full_layers * page_bytes(cfg, kv_page_size, dtype, kv_bits, kv_group_size)
    fix = "" if kv_bits == 4 else " or pass --kv-bits 4"
    gpu = "GPU " if on_cuda else ""

    def kv(slots: int, pages: int) -> int:
        return paged_kv_cache_bytes(cfg, slots, context, dtype, kv_bits, kv_group_size,
                                    kv_page_size, pages, chunk, scratch)

    def needs(slots: int) -> tuple[int, int]:  # the least a start needs: one sequence's pages
        return kv(slots, per_seq), activations(slots)

    if max_batch is not None:
        slots, slots_reason = max_batch, "--max-batch"
        need, act = needs(slots)
        if free is not None and need + act > free:
            fit = _most(needs, free, max_batch - 1)
            raise UserError(
                f"--max-batch {max_batch}: {max_batch} slots with one sequence of {context} "
                f"tokens in pages need {gib(need)} of KV cache (and about {gib(act)} for "
                f"activations), but {gib(free)} of {gpu}memory is free; "
                + (f"at most {fit} slots fit, or " if fit else "") + "lower --max-kv-size" + fix)
    else:
        cap = AUTO_MAX_BATCH if on_cuda else CPU_MAX_BATCH
        budget = None if free is None else int(MEMORY_FRACTION * free)
        slots = cap if budget is None else _most(needs, budget, cap)
        if slots == 0:
            need, act = needs(1)
            raise UserError(
                f"one sequence of {context} tokens in pages needs {gib(need)} of KV cache "
                f"(and about {gib(act)} for activations), over {MEMORY_FRACTION:.0%} of the "
                f"{gib(free)} of {gpu}memory free; lower --max-kv-size" + fix)
        slots_reason = "auto, capped" if slots == cap else "auto"
    act = activations(slots)
    if kv_pages is not None:
        pages, pages_reason = kv_pages, "--kv-pages"
        if free is not None and kv(slots, pages) + act > free:
            most = per_seq + max(0, free - act - kv(slots, per_seq)) // max(per_page, 1)
            raise UserError(
                f"--kv-pages {pages}: {pages} pages of {kv_page_size} tokens need "
                f"{gib(kv(slots, pages))} of KV cache with {slots} slots (and about "
                f"{gib(act)} for activations), but {gib(free)} of {gpu}memory is free; "
                + (f"at most {most} pages fit, or " if most >= per_seq
                   and kv(slots, most) + act <= free else "")
                + "leave --kv-pages out to size them by the free memory")
    else:
        every = slots * per_seq  # every slot at the context: the engine's own default
        if free is None or per_page == 0:  # unknown memory, or no full-attention layer
            pages, pages_reason = every, "auto, capped"
        else:
            left = int(MEMORY_FRACTION * free) - act - kv(slots, per_seq)
            pages, pages_reason = per_seq + max(0, left) // per_page, "auto"
            # On a CPU the memory is the machine's: take no more than a slotted cache.
            if not on_cuda and pages >= every:
                pages, pages_reason = every, "auto, capped"
    return Plan(slots, slots_reason, context, kv(slots, pages), act, free, total, cuda_graph,
                graph_reason, str(device), kv_page_size, pages, pages_reason)


def _most(needs, budget: int, cap: int) -> int:
    """The most slots, at most ``cap``, whose needs fit ``budget`` bytes (0: none); the
    needs grow with the slots, so a bisection finds it."""
    lo, hi = 0, cap  # lo fits (0 trivially); the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(needs(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
