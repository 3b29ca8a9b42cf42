"""Which modules become units, and which unit owns each parameter.

Default: the blocks of every outermost repeated stack (an ``nn.ModuleList``, ``nn.Sequential`` or
``nn.ModuleDict`` of two or more children of one type, e.g. the transformer blocks; torchtitan keeps its
layers in a ``ModuleDict``) are units; everything else belongs to the root unit. When the default leaves one
unit holding most of a sizeable model (no stack found: the whole model gathered at once, no memory saved),
:func:`dominant_unit_warning` says so, naming ``wrap=``.

A parameter registered in several modules (a tied embedding and LM head) belongs to the deepest unit that
contains all of its registrations, so it is gathered once and is live wherever it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from hsdp.engine.runtime.sharded_param import ParamSlot

WrapPolicy = (Callable[[nn.Module], bool] | type[nn.Module] | str
              | Iterable[type[nn.Module] | str] | None)


def _is_repeated_stack(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        return False
    children = list(module.children())
    return len(children) >= 2 and len({type(c) for c in children}) == 1


def _default_units(root: nn.Module) -> list[nn.Module]:
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if _is_repeated_stack(child):
                units.extend(child.children())  # outermost stacks only: do not descend into blocks
            else:
                visit(child)

    visit(root)
    return units


def _as_predicate(wrap: WrapPolicy) -> Callable[[nn.Module], bool] | None:
    """A predicate from a class, a class name, a list/tuple/set of either (accelerate's
    ``transformer_layer_cls_to_wrap`` takes names, Lightning a set of classes), or a callable."""
    if wrap is None:
        return None
    if isinstance(wrap, type) and issubclass(wrap, nn.Module):
        return lambda m: isinstance(m, wrap)
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    items = [wrap] if isinstance(wrap, str) else wrap
    if isinstance(items, (list, tuple, set, frozenset)) and items:
        classes = tuple(w for w in items if isinstance(w, type) and issubclass(w, nn.Module))
        names = frozenset(w for w in items if isinstance(w, str))
        if len(classes) + len(names) == len(items):
            return lambda m: isinstance(m, classes) or type(m).__name__ in names
    raise ValueError(
        f"wrap must be a module class, a class name, a list/tuple/set of classes or class names, or a callable "
        f"module -> bool; got {wrap!r}"
    )


def _check_names_exist(root: nn.Module, wrap: WrapPolicy) -> None:
    """A class name that matches no module is almost always a typo: say so instead of wrapping nothing."""
    items = [wrap] if isinstance(wrap, str) else wrap
    if not isinstance(items, (list, tuple, set, frozenset)):
        return
    present = {type(m).__name__ for m in root.modules()}
    missing = sorted(w for w in items if isinstance(w, str) and w not in present)
    if missing:
        raise ValueError(f"wrap names module classes not in the model: {missing}; classes present include "
                         f"{sorted(present)[:12]}")


def select_unit_modules(root: nn.Module, wrap: WrapPolicy, exclude: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """Unit modules in pre-order, root first; subtrees of ``exclude`` (already-wrapped modules) skipped."""
    excluded = set(map(id, exclude))
    pred = _as_predicate(wrap)
    _check_names_exist(root, wrap)
    if pred is None:
        chosen = _default_units(root)
    else:
        chosen = [m for m in root.modules() if m is not root and pred(m)]
    out = [root]
    for m in chosen:
        if id(m) not in excluded and not _inside_any(root, m, excluded):
            out.append(m)
    return out


# Below this many parameters a single unit costs little memory, and tiny models (embeddings larger than their
# blocks) would warn for nothing.
_DOMINANT_MIN_PARAMS = 1_000_000
_DOMINANT_SHARE = 0.5


def dominant_unit_warning(root: nn.Module, wrap: WrapPolicy, assignments: list[ParamAssignment]) -> str | None:
    """With the default policy (``wrap=None``), a message when one unit owns more than half of a model of at
    least a million parameters: that unit is all-gathered whole, so per-rank memory at its peak is not cut by
    the shard degree. ``None`` otherwise (an explicit ``wrap`` is the user's choice)."""
    if wrap is not None:
        return None
    sizes: dict[int, int] = {}
    for a in assignments:
        sizes[id(a.owner)] = sizes.get(id(a.owner), 0) + a.param.numel()
    total = sum(sizes.values())
    if total < _DOMINANT_MIN_PARAMS:
        return None
    owner_id, biggest = max(sizes.items(), key=lambda kv: kv[1])
    if biggest <= _DOMINANT_SHARE * total:
        return None
    name = next((n or type(root).__name__ + " (the root)" for n, m in root.named_modules() if id(m) == owner_id), "?")
    return (f"hsdp's default units leave {biggest / total:.0%} of the parameters in one unit, {name}: it is "
            f"all-gathered whole, so sharding saves little memory there. No repeated stack of blocks (ModuleList, "
            f"Sequential or ModuleDict of one module type) was found; pass wrap= with the block class"
            f"{_candidates(root, total)}")


def _candidates(root: nn.Module, total: int) -> str:
    """Module classes that repeat and hold a fair share of the parameters: likely blocks, for the message."""
    counts: dict[str, int] = {}
    for m in root.modules():
        if m is not root and sum(p.numel() for p in m.parameters()) >= total / 64:
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    names = sorted(n for n, c in counts.items() if c >= 2)[:4]
    return f", e.g. wrap={names!r}" if names else ""


def _inside_any(root: nn.Module, target: nn.Module, excluded: set[int]) -> bool:
    return any(id(m) in excluded and any(x is target for x in m.modules()) for m in root.modules())


@dataclass
class ParamAssignment:
    """A parameter, every place it is registered, and the unit module that owns it."""

    param: nn.Parameter
    slots: list[ParamSlot]
    owner: nn.Module


def assign_params(root: nn.Module, unit_modules: list[nn.Module],
                  skip: Iterable[nn.Module] = ()) -> list[ParamAssignment]:
    """Map each parameter (deduplicated) to its owning unit: the deepest unit holding all its slots.

    Modules inside ``skip`` (already wrapped) are not visited: their units exist already.
    """
    is_unit = {id(m) for m in unit_modules}
    skipped = {id(m) for m in skip}
    enclosing: dict[int, list[nn.Module]] = {}  # module id -> chain of enclosing units, outermost first
    found: dict[int, ParamAssignment] = {}

    def visit(m: nn.Module, prefix: str, chain: list[nn.Module]) -> None:
        if id(m) in is_unit:
            chain = [*chain, m]
        enclosing[id(m)] = chain
        for name, p in m._parameters.items():
            if p is None:
                continue
            slot = ParamSlot(m, name, f"{prefix}{name}")
            if id(p) in found:
                a = found[id(p)]
                a.slots.append(slot)
                a.owner = _common_prefix(enclosing.get(id(a.owner), []), chain)[-1]
            else:
                found[id(p)] = ParamAssignment(p, [slot], chain[-1])
        for cname, child in m._modules.items():
            if child is not None and id(child) not in skipped:
                visit(child, f"{prefix}{cname}.", chain)

    visit(root, "", [])
    return list(found.values())


def _common_prefix(a: list[nn.Module], b: list[nn.Module]) -> list[nn.Module]:
    out = []
    for x, y in zip(a, b):
        if x is not y:
            break
        out.append(x)
    return out
