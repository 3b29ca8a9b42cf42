"""``hsdp.engine.collectives.Comm`` is the only caller of torch.distributed collectives in hsdp: that is what
lets it count, time and profile every byte. Read from the source (``ast``), so no process group is needed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hsdp"
OWNER = PACKAGE / "engine" / "collectives.py"
# all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast_object_list, batch_isend_irecv, ...
COLLECTIVE = re.compile(r"^(all_reduce\w*|all_gather\w*|reduce_scatter\w*|broadcast\w*|\w*barrier|all_to_all\w*|"
                        r"i?send|i?recv|batch_isend_irecv|gather\w*|scatter\w*|reduce)$")
DISTRIBUTED = ("torch.distributed", "torch.distributed.distributed_c10d")


def _distributed_aliases(tree: ast.Module) -> set[str]:
    """Names bound to torch.distributed: ``import torch.distributed as dist``, ``from torch import
    distributed``; plain ``import torch`` makes ``torch.distributed`` (the dotted name) reachable."""
    names = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.name in DISTRIBUTED and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names.update(a.asname or a.name for a in node.names if a.name == "distributed")
    return names


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def collective_calls(source: str) -> list[str]:
    """``line: call`` of each torch.distributed collective that ``source`` calls or imports by name."""
    tree = ast.parse(source)
    aliases = _distributed_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in DISTRIBUTED:
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if COLLECTIVE.match(a.name)]
        elif isinstance(node, ast.Attribute) and COLLECTIVE.match(node.attr):
            # Attributes, not only calls: passing dist.all_reduce along would escape Comm as well.
            owner = _dotted(node.value)
            if owner in aliases or any(owner == f"{a}.distributed_c10d" for a in aliases):
                found.append(f"{node.lineno}: {owner}.{node.attr}")
    return found


def test_only_comm_calls_torch_distributed_collectives() -> None:
    offenders = {
        str(path.relative_to(PACKAGE.parent)): calls
        for path in sorted(PACKAGE.rglob("*.py")) if path != OWNER
        for calls in [collective_calls(path.read_text())] if calls
    }
    assert not offenders, f"route these through hsdp.engine.collectives.Comm: {offenders}"


def test_the_check_sees_every_spelling() -> None:
    source = """
import torch
import torch.distributed as dist
from torch import distributed as d2
from torch.distributed import all_gather_into_tensor
dist.barrier()
torch.distributed.all_reduce(t)
d2.broadcast(t, 0)
f = dist.reduce_scatter_tensor
dist.distributed_c10d.send(t, 1)
dist.get_rank(); dist.ReduceOp.MAX; dist.init_process_group("gloo")
"""
    assert sorted(int(c.split(":")[0]) for c in collective_calls(source)) == [5, 6, 7, 8, 9, 10]
