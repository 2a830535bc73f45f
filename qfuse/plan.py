"""The plan: a model's forward as an ordered list of op sites, each chosen once.

A `Site` is one op of a forward (a layer's Q/K/V product, its attention, a residual
joint, the head, ...), declared by the model with what is static about it (weights, eps,
activation) and a chooser from `qfuse.choose`. The first call of a site makes its choice
from the call's own tensors (so the choice is exactly what the per-call dispatch would
make for that layout) and keeps it; every later call runs the kept launcher: no
environment read, no support check, no kernel choice.

A `Plan` holds the sites of one kind of pass (a decode step, or a prefill) for one key:
the tier and levers in force (`levers.plan_state`), gradients on or off (on: every site
chooses at every call, as training needs), autocast, the row count
(decode: the batch; prefill: the batch, the prompt length and which logits it returns)
and the KV cache's format. `Plans` keeps a model's plans; a lever changed through `levers`
or a `use_tier` block gives another key, so a new plan. Sites bind the weights as held
when the plan was made: after changing weights other than through the model's own
`load_state_dict`/`.to()`/`hold_kernel_forms`, call `Decoder.replan()`. `Plan.sites` lists the sites in
the order they first ran, with kernel and reason: data, which `qfuse info` prints and
which a persistent program can walk.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

from . import levers
from .choose import Choice

# Plans kept per model: decode batch sizes and prefill shapes in use, a handful each.
MAX_PLANS = 64


class SiteOrder(list):
    """A plan's sites in the order they first ran. Its sites hold it weakly: a site in
    the list holding the list would be a cycle, and a cycle keeps the modules and weights
    the sites bind until the garbage collector's next pass, after their model is gone."""


class Site:
    """One op site: ``name`` (where in the model), ``op`` (what it computes), and
    ``choose(*args) -> Choice`` taking the arguments its calls take; ``finish(choice)``
    may wrap the chosen launcher (a tensor-parallel module adds its reduction)."""

    __slots__ = ("_choose", "_finish", "_order", "choice", "keep", "name", "op")

    def __init__(self, name: str, op: str, choose: Callable[..., Choice],
                 order: SiteOrder, finish: Callable[[Choice], Choice] | None = None):
        self.name, self.op, self._choose, self._finish = name, op, choose, finish
        self._order = weakref.ref(order)  # the plan's, joined at this site's first call
        self.choice: Choice | None = None
        self.keep = True  # False: choose at every call (`Plan.per_call`)

    def __call__(self, *args):
        choice = self.choice
        if choice is None or not self.keep:
            choice = self._choose(*args)
            if self._finish is not None:
                choice = self._finish(choice)
            if self.choice is None:
                order = self._order()
                if order is not None:  # None: the plan is gone, only this site is left
                    order.append(self)
            self.choice = choice
        return choice(*args)


@dataclasses.dataclass
class Plan:
    """The sites of one pass kind for one key; ``layers[i]`` maps a site's short name to
    the Site of layer i, ``model`` the sites outside the layers."""

    kind: str
    key: tuple
    layers: list[dict[str, Site]]
    model: dict[str, Site]
    sites: SiteOrder  # in the order they first ran

    def describe(self) -> list[str]:
        """One line a site: name, op, kernel, and why."""
        width = max((len(s.name) for s in self.sites), default=0)
        return [f"{s.name:<{width}}  {s.op:<18} {s.choice.kernel:<16} {s.choice.reason}"
                for s in self.sites]

    def per_call(self) -> None:
        """Every site chooses at every call (gradients on: whether autograd must see an op
        depends on the tensors of that call, which the key does not hold)."""
        for sites in (*self.layers, self.model):
            for site in sites.values():
                site.keep = False

    def kernels(self) -> dict[str, int]:
        """Sites per chosen kernel."""
        out: dict[str, int] = {}
        for s in self.sites:
            out[s.choice.kernel] = out.get(s.choice.kernel, 0) + 1
        return out


def cache_format(cache) -> tuple:
    """What a cache's layout decides in a plan (kind; per distinct layer layout, the
    tensors' kind, shape, dtype, bits and group), made once per cache object."""
    if cache is None:
        return ()
    known = getattr(cache, "_plan_format", None)
    if known is None:
        layouts = []
        for layer in cache.layers:
            k = layer.k
            entry = (type(k).__name__, tuple(k.shape), str(k.dtype),
                     getattr(k, "bits", 0), getattr(k, "group_size", 0))
            if entry not in layouts:
                layouts.append(entry)
        known = (type(cache).__name__, tuple(layouts))
        try:
            cache._plan_format = known
        except AttributeError:  # a cache with slots: computed each time
            pass
    return known


class Plans:
    """A model's plans by key, the newest kept (at most MAX_PLANS)."""

    def __init__(self, make: Callable[[str, tuple], Plan]):
        # A model's own method, held weakly: the model holds its Plans, and a strong
        # reference back would make a cycle that only the garbage collector frees, so
        # `del model` would keep a GPU's weights until the next collection.
        self._make = weakref.WeakMethod(make) if inspect.ismethod(make) else lambda: make
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()

    def get(self, kind: str, rows, cache=None) -> Plan:
        """The plan of a ``kind`` pass ("decode", "prefill", "chunk") over ``rows`` (what
        sets the sites' row counts: the batch of a decode step, a prefill's batch, length
        and logits kind) with ``cache``, made on first use."""
        grad = torch.is_grad_enabled()
        autocast = (torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"))
        key = (kind, rows, levers.plan_state(), grad, autocast, cache_format(cache))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make()(kind, key)
            if grad:
                plan.per_call()
            if len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)  # the least recently used
        else:
            self._plans.move_to_end(key)
        return plan

    def clear(self) -> None:
        """Forget every plan (weights replaced, moved or re-held)."""
        self._plans.clear()

    def __deepcopy__(self, memo):
        """A copied model plans anew: the kept choices bound the original's weights."""
        import copy

        return Plans(copy.deepcopy(self._make(), memo))

    def __iter__(self):
        return iter(self._plans.values())
