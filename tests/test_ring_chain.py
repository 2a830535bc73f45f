"""The ring chain (one persistent Gluon launch for a chain of dependent 4-bit products;
GPU cases marked `gpu`, Hopper only): every y_i bit for bit the chain of `qmatmul_ring`
calls at the same splits of K (Gemma-like and odd shapes, groups 64/128, 1/4/8 rows,
forced splits), the first product within twice compat's error, CUDA-graph replay of one
launch and of two back to back, the counters and split semaphores zero after each launch,
the timed form's outputs bitwise the untimed ones and its clocks within each role's span;
on the CPU, the dealing of work items (chain order per program, each item once, balance),
what it refuses, and the folding of a timing buffer into shares."""

from itertools import pairwise

import pytest
import torch

from qfuse.kernels.products import fragments
from qfuse.kernels.products import qmatmul_ring as ring
from qfuse.kernels.products import ring_chain as rc
from qfuse.kernels.products.splitk import semaphores
from qfuse.testing import check_bf16_product, linear_case, on_hopper
from qfuse.testing import cuda_4bit_case as case

needs_hopper = pytest.mark.skipif(not on_hopper(), reason="the ring chain needs sm_90")

GEMMA = (4096, 3840, 15360, 3840)  # o, up, down of a Gemma 3 12B layer: K_0, N_0, N_1, N_2
ODD = (640, 1024, 192, 37)


def chain_case(dims, M, group, seed):
    """x [M, dims[0]] and weights W_i [dims[i+1], dims[i]] held in fragment order, with the
    quantized forms for the error check."""
    x, w0 = case(M, dims[1], dims[0], group, seed)
    ws = [w0] + [case(1, n, k, group, seed + i + 1)[1]
                 for i, (k, n) in enumerate(pairwise(dims[1:]))]
    return x, ws, [fragments.repack(w) for w in ws]


def ring_calls(x, fs, splits=None):
    """The same chain as separate `qmatmul_ring` launches."""
    ys = []
    for i, f in enumerate(fs):
        x = ring.qmatmul_ring(x, f, **({"split": splits[i]} if splits else {}))
        ys.append(x)
    return ys


def assert_counters_zero(device):
    """The chain's counters and the split semaphores, as the launches left them."""
    torch.cuda.synchronize()
    assert not rc.counters(device).any()
    assert not semaphores(device).any()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("dims,group", [(GEMMA, 64), (ODD, 64), ((1024, 768, 1280, 5), 128)])
def test_every_output_is_the_ring_calls_bit_for_bit(dims, group, M):
    x, ws, fs = chain_case(dims, M, group, seed=M + group)
    chain = rc.RingChain(fs)
    ys = chain(x)
    expected = ring_calls(x, fs)
    for i, (y, e) in enumerate(zip(ys, expected)):
        assert y.shape == e.shape and torch.equal(y, e), f"y_{i} differs"
    check_bf16_product(ys[0], x, ws[0])
    assert_counters_zero(x.device)
    assert all(torch.equal(a, b) for a, b in zip(chain(x), ys))  # again: counters reset


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("splits", [(1, 1, 1), (3, 1, 8), (2, 4, 1, 5)])
def test_forced_splits_match_the_ring_calls_at_those_splits(splits):
    dims = (1536, 1024, 640, 1024, 200)[:len(splits) + 1]
    x, _, fs = chain_case(dims, 3, 64, seed=len(splits))
    ys = rc.RingChain(fs, splits=splits)(x)
    for y, e in zip(ys, ring_calls(x, fs, splits)):
        assert torch.equal(y, e)
    assert_counters_zero(x.device)


@pytest.mark.gpu
@needs_hopper
def test_graph_replay_one_and_two_launches():
    x, _, fs = chain_case(GEMMA, 4, 64, seed=5)
    chain = rc.RingChain(fs)
    back = rc.RingChain([fragments.repack(case(1, 4096, 3840, 64, 11)[1])])
    back(chain(x)[-1])  # eager first calls: counters, semaphores, compiles
    xs = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = chain(xs)
        z = back(ys[-1])[0]  # a second chain launch right behind (PDL)
    for seed in range(3):
        torch.manual_seed(seed)
        xs.copy_(torch.randn(4, 4096, device="cuda").bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        expected = ring_calls(xs, fs)
        assert all(torch.equal(a, b) for a, b in zip(ys, expected))
        assert torch.equal(z, ring.qmatmul_ring(expected[-1], back.weights[0]))
        assert_counters_zero(x.device)


@pytest.mark.gpu
@needs_hopper
def test_rows_independent_of_the_batch():
    x, _, fs = chain_case(GEMMA, 8, 64, seed=2)
    full = rc.RingChain(fs)(x)[-1]
    for rows in (1, 3):
        assert torch.equal(rc.RingChain(fs)(x[:rows])[-1], full[:rows])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dims,splits,M", [(GEMMA, None, 1), (ODD, None, 8),
                                          ((1536, 1024, 640, 1024, 200), (2, 4, 1, 5), 3)])
def test_timed_chain_gives_the_same_bits_and_clocks_within_each_span(dims, splits, M):
    """The timed form: every y_i bitwise the untimed chain's, twice (the counters reset),
    and in its buffer every bucket non-negative and each role's buckets summing to at most
    its own end - start, within the program's span. No tolerance: every bucket is a sum of
    differences between consecutive reads of one SM counter by the same warp, inside the
    role's start and end reads (telescoping), so timer granularity cannot push it over."""
    x, _, fs = chain_case(dims, M, 64, seed=M)
    ys = rc.RingChain(fs, splits=splits)(x)
    timed = rc.RingChain(fs, splits=splits, timed=True)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(timed(x), ys))
        assert_counters_zero(x.device)
    buf = timed.timing.cpu()
    assert buf.shape == (timed.programs, rc.SLOTS)
    buckets = {0: len(rc.PRODUCER_BUCKETS)} | {r: len(rc.CONSUMER_BUCKETS)
                                               for r in range(1, rc.ROLES)}
    for g, row in enumerate(buf.tolist()):
        roles = [row[r * rc.ROLE:(r + 1) * rc.ROLE] for r in range(rc.ROLES)]
        span = max(r[1] for r in roles) - min(r[0] for r in roles)
        for r, role in enumerate(roles):
            start, end, first_ns, last_ns = role[:4]
            spent = role[4:4 + buckets[r]]
            assert 0 < end - start <= span and first_ns <= last_ns, (g, r)
            assert min(spent) >= 0 and sum(spent) <= end - start, (g, r, spent, end - start)
            assert spent[-1] > 0, (g, r)  # issued, or stored: every program has an item
    timing = rc.fold_timing(timed.timing)
    for name, shares in timing.shares.items():
        assert min(shares) >= 0, name
    assert timing.summary()["programs"] == timed.programs


def test_fold_timing_gives_each_programs_shares_exactly():
    """A hand-made buffer of two programs: shares of each program's span (the consumer
    buckets as the mean of the four warps), the rest as "other", and the summary's
    globaltimer figures and mean/min/max across programs."""
    def program(start, span, ns0, producer, consumers):
        row = []
        row += [start, start + span // 2, ns0, ns0 + 300] + producer + [0] * 3
        for w, spent in enumerate(consumers):
            row += [start + w, start + span - w, ns0 + 10 * w, ns0 + 500 + 10 * w] + spent
        return row
    flat = [64, 128, 256, 384, 64]  # launch, counter, ready, compute, store
    p0 = program(1000, 1024, 5000, [256, 128], [flat] * 4)
    p1 = program(9000, 2048, 5100, [1024, 512],
                 [[0, 0, 512, 1024, 0], [0, 512, 512, 512, 0], [0, 1024, 0, 512, 0],
                  [0, 512, 512, 512, 0]])
    assert len(p0) == rc.SLOTS
    timing = rc.fold_timing(torch.tensor([p0, p1], dtype=torch.int64))
    assert timing.span_cycles == (1024, 2048)
    assert timing.first_ns == (5000, 5100) and timing.last_ns == (5530, 5630)
    want = {"producer_slot_wait": (0.25, 0.5), "producer_issue": (0.125, 0.25),
            "producer_other": (0.625, 0.25),
            "consumer_launch_wait": (0.0625, 0.0), "consumer_counter_wait": (0.125, 0.25),
            "consumer_ready_wait": (0.25, 0.1875), "consumer_compute": (0.375, 0.3125),
            "consumer_store": (0.0625, 0.0), "consumer_other": (0.125, 0.25)}
    assert timing.shares == want
    summary = timing.summary()
    assert (summary["programs"], summary["launch_ns"], summary["start_spread_ns"],
            summary["end_spread_ns"]) == (2, 630, 100, 100)
    assert summary["span_cycles"] == {"mean": 1536, "min": 1024, "max": 2048}
    assert summary["shares"]["consumer_counter_wait"] == {"mean": 0.1875, "min": 0.125,
                                                          "max": 0.25}
    assert summary["shares"]["producer_other"] == {"mean": 0.4375, "min": 0.25, "max": 0.625}
    with pytest.raises(ValueError, match="programs"):
        rc.fold_timing(torch.zeros(2, rc.SLOTS - 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="no span"):
        rc.fold_timing(torch.zeros(1, rc.SLOTS, dtype=torch.int64))


def test_deal_keeps_chain_order_and_every_item_once():
    costs = [[16] * 240, [15] * 240, [15] * 240, [3, 5, 7]]
    lists = rc.deal(costs, 132)
    dealt = sorted(item for items in lists for item in items)
    assert dealt == sorted((p, i) for p, c in enumerate(costs) for i in range(len(c)))
    for items in lists:
        assert [p for p, _ in items] == sorted(p for p, _ in items)
    # each product's items as even as they go: 240 over 132 programs is 1 or 2 each
    for p in range(3):
        per = [sum(1 for q, _ in items if q == p) for items in lists]
        assert max(per) - min(per) <= 1
    # and a program short of one product's items gets the next product's extra ones
    totals = [sum(costs[p][i] for p, i in items) for items in lists]
    assert max(totals) - min(totals) <= 16


def test_refusals_name_the_reason():
    w = lambda n, k, g=64: fragments.repack(linear_case(1, n, k, 4, g, 0)[1])
    assert "takes 128 features" in rc.chain_reason([w(64, 128), w(32, 128)])
    assert "group sizes differ" in rc.chain_reason([w(128, 128), w(32, 128, 128)])
    assert "products" in rc.chain_reason([])
    assert "products" in rc.chain_reason([w(64, 64)] * (rc.MAX_PRODUCTS + 1))
    reason = rc.chain_reason([w(64, 128), w(32, 64)])
    assert reason and ("CUDA" in reason or "Gluon" in reason or "sm_90" in reason)
    with pytest.raises(ValueError, match="ring_chain cannot take"):
        rc.RingChain([w(64, 128), w(32, 128)])
    f = w(64, 128)
    assert "rows" in rc.input_reason(torch.zeros(9, 128, dtype=torch.bfloat16), f)
    assert "dtype" in rc.input_reason(torch.zeros(2, 128), f)
    assert "features" in rc.input_reason(torch.zeros(2, 64, dtype=torch.bfloat16), f)
    assert rc.input_reason(torch.zeros(8, 128, dtype=torch.bfloat16), f) is None


def _held(n, k, group=64):
    """A fragment weight's shapes without its values (the tables depend on shapes only)."""
    T, G = -(-n // 16), k // group
    z = torch.zeros
    return fragments.FragmentWeight(z(T, k // 64, 32, 4, dtype=torch.int32),
                                    z(T, G, 8, dtype=torch.int32),
                                    z(T, G, 8, dtype=torch.int32), n, k, group)


@pytest.mark.parametrize("dims,splits", [(GEMMA, None), ((4096, 4096, 14336, 4096), None),
                                         (ODD, None), ((1536, 1024, 640, 1024, 200), (2, 4, 1, 5))])
def test_tables_run_to_the_end_as_the_kernel_walks_them(dims, splits, monkeypatch):
    """The host tables walked as the kernel walks them, in a random interleaving of
    programs: every item once, every product's counter reaching its target exactly when its
    last item is counted, no program left waiting (deadlock), no item of a product before
    its input is complete."""
    monkeypatch.setattr(rc, "chain_reason", lambda weights: None)
    monkeypatch.setattr(rc.ring, "descriptors", lambda f, cb: (None, None, None))
    fs = [_held(n, k) for k, n in pairwise(dims)]
    chain = rc.RingChain(fs, splits=splits)
    P, meta = len(fs), chain.meta.tolist()
    lists = [[tuple(chain.items[g, k, :3].tolist()) for k in range(chain.counts[g])]
             for g in range(chain.programs)]
    dealt = sorted(item for items in lists for item in items)
    want = sorted((p, t, sp) for p, ls in enumerate(chain.shapes)
                  for t in range(ls["grid"][0]) for sp in range(ls["SPLIT"]))
    assert dealt == want
    for p, (N, KB, bpp, split, target, sem0, _, _) in enumerate(meta):
        assert (N, KB, split) == (fs[p].n, fs[p].k // 64, chain.shapes[p]["SPLIT"])
        assert target == chain.shapes[p]["grid"][0] * rc.TT * 32
        assert sum(min(bpp, KB - sp * bpp) for sp in range(split)) == KB
        assert bpp % chain.cb == 0 and KB % chain.cb == 0
    # split semaphore regions: disjoint, within the buffer
    spans = sorted((m[5], m[5] + m[4]) for m in meta if m[3] > 1)
    assert all(a[1] <= b[0] for a, b in pairwise(spans))
    assert _walk(lists, meta, P, seed=len(dims)) == [m[4] for m in meta]


def _walk(lists, meta, P, seed):
    """Walk per-program item lists as the kernel does, in a random interleaving of the
    programs: a program's next item of product p > 0 runs once product p-1's counter has
    reached its target (meta[p-1][4]). Returns each product's final count; an
    AssertionError where every unfinished program waits (deadlock)."""
    programs = len(lists)
    count = [0] * P
    pos = [0] * programs
    gen = torch.Generator().manual_seed(seed)
    while any(pos[g] < len(lists[g]) for g in range(programs)):
        ready = [g for g in range(programs) if pos[g] < len(lists[g]) and (
            lists[g][pos[g]][0] == 0 or count[lists[g][pos[g]][0] - 1] == meta[
                lists[g][pos[g]][0] - 1][4])]
        assert ready, "every program waits: deadlock"
        g = ready[torch.randint(len(ready), (1,), generator=gen).item()]
        p = lists[g][pos[g]][0]
        # a split item counts the lanes it was last for: all of them once per row group
        # over its splits; here the last split to run counts the tile's 128 lanes
        done = sum(1 for h in range(programs) for k, it in enumerate(lists[h])
                   if it[:2] == lists[g][pos[g]][:2] and k < pos[h]) + 1
        if done == meta[p][3]:
            count[p] += rc.TT * 32
        pos[g] += 1
    return count


def test_a_list_out_of_chain_order_is_seen_to_deadlock(monkeypatch):
    """The walk above can fail: each program's list reversed (a later product's items
    first) leaves every program waiting."""
    monkeypatch.setattr(rc, "chain_reason", lambda weights: None)
    monkeypatch.setattr(rc.ring, "descriptors", lambda f, cb: (None, None, None))
    fs = [_held(n, k) for k, n in pairwise(GEMMA)]
    chain = rc.RingChain(fs)
    lists = [[tuple(chain.items[g, k, :3].tolist()) for k in range(chain.counts[g])][::-1]
             for g in range(chain.programs)]
    with pytest.raises(AssertionError, match="deadlock"):
        _walk(lists, chain.meta.tolist(), len(fs), seed=0)
