"""``hsdp env``: the bug-report facts, in-process (``main([...])``), with torchrun's variables faked; the mesh
comes from the same function ``init_mesh`` uses, without a process group."""

from __future__ import annotations

import json
import platform
import socket

import pytest
import torch
import torch.distributed as dist

from hsdp import __version__
from hsdp.apps.cli import main

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "HSDP_SHARDING_DEGREE")


def _env_json(capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["env", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _rank_of(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_env_reports_versions_devices_backends_and_network(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _rank_of(monkeypatch)
    info = _env_json(capsys)
    assert info["versions"]["hsdp"] == __version__ and info["versions"]["torch"] == torch.__version__
    assert info["versions"]["python"] == platform.python_version()
    assert info["cuda"]["available"] == torch.cuda.is_available()
    if torch.cuda.is_available():  # a GPU machine: every device and NCCL's version
        assert len(info["cuda"]["devices"]) == torch.cuda.device_count() and info["cuda"]["nccl"]
    assert info["backends"]["gloo"] == dist.is_gloo_available()
    assert info["backends"]["nccl"] == dist.is_nccl_available()
    assert info["launch_variables"] == {} and "WORLD_SIZE is not set" in info["mesh"]["not_a_rank"]
    assert "error" not in info["mesh"]
    names = {i["name"] for i in info["network"]}
    assert {name for _, name in socket.if_nameindex()} <= names
    loopback = next(i for i in info["network"] if i["name"] == "lo")
    assert "127.0.0.1" in loopback["addresses"]
    emulation = info["emulation"]
    assert set(emulation) >= {"root", "ip", "tc", "usable", "reason"}
    assert emulation["usable"] == (emulation["reason"] is None)
    assert not dist.is_initialized()


@pytest.mark.parametrize(("variables", "mesh"), [
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, {"replicate": 2, "shard": 4}),  # HSDP: ranks per node
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "HSDP_SHARDING_DEGREE": "8"}, {"replicate": 1, "shard": 8}),
])
def test_env_shows_the_mesh_init_mesh_would_build(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variables: dict, mesh: dict) -> None:
    _rank_of(monkeypatch, RANK="3", MASTER_ADDR="node0", MASTER_PORT="29500", **variables)
    info = _env_json(capsys)
    assert {k: info["mesh"][k] for k in mesh} == mesh and info["mesh"]["notes"] == []
    assert info["launch_variables"] == {"RANK": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "29500", **variables}
    assert not dist.is_initialized()


def test_env_names_a_bad_layout_and_prints_text(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _rank_of(monkeypatch, RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", HSDP_SHARDING_DEGREE="3")
    assert "not divisible by sharding_degree=3" in _env_json(capsys)["mesh"]["error"]
    _rank_of(monkeypatch, RANK="0", WORLD_SIZE="6", LOCAL_WORLD_SIZE="3", HSDP_SHARDING_DEGREE="2")
    notes = _env_json(capsys)["mesh"]["notes"]
    assert len(notes) == 1 and "cross the slow link" in notes[0]  # init_mesh's node-crossing warning
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for line in ("versions:", f"  torch: {torch.__version__}", "mesh:", "  world_size: 6", "  shard: 2",
                 "  HSDP_SHARDING_DEGREE: 2", "emulation:"):
        assert line in text.splitlines(), text
