"""The command line's torch-free paths stay torch-free: `hsdp version`, `hsdp plan` and every `--help`
answer in a fraction of a second instead of paying for `import torch` (about 2 s)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
import hsdp.apps.cli
hsdp.apps.cli.build_parser()
code = hsdp.apps.cli.main({argv!r})
assert "torch" not in sys.modules, "torch was imported"
print("exit", code)
"""


@pytest.mark.parametrize("argv", [["version"], ["plan", "--model", "7b", "--nodes", "2", "--gpus-per-node", "8"]])
def test_torch_free_commands_do_not_import_torch(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "exit 0" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_public_api_is_still_importable_by_name() -> None:
    import hsdp

    assert set(hsdp.__all__) <= set(dir(hsdp))
    for name in hsdp.__all__:  # every lazy export resolves to the object its module defines
        value = getattr(hsdp, name)
        assert getattr(sys.modules[value.__module__], name) is value
    from hsdp import ShardedModel
    from hsdp.engine.model import ShardedModel as Defined

    assert ShardedModel is Defined

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = hsdp.nope
