"""Every file in examples/ runs as the README launches it, at tiny sizes, and does what it claims.

Each Python example runs under ``torchrun --nproc-per-node 4`` on CPU (gloo), one launch per example (two for
the big-model recipe: export, then load back); ``slurm_hsdp.sbatch`` (with ``hsdp_train.toml``, its default
config) runs under stand-ins for ``srun`` and ``scontrol``, twice, as a requeued job does. The seed tutorial's
own test is tests/test_seed_example.py. The checks are the examples' claims: the loss falls, what is saved
reloads to the same weights (a reloaded model's loss equals the trained model's, files equal bit for bit), a
requeued job resumes from its checkpoint, the tensor-parallel run's inter-node bytes sit at the floor.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240  # four ranks importing torch and a framework on a loaded 2-core machine


def _env(**extra: str) -> dict[str, str]:
    # One thread per rank: 4 ranks on a small CI machine otherwise oversubscribe its cores many times over.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **extra}


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run ``cmd``; its output (stdout and stderr), or the test fails with it."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {TIMEOUT_S}s:\n{e.stdout}\n{e.stderr}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output}"
    return output


def _torchrun(example: str, *args: str, cwd: Path) -> str:
    """``torchrun --nproc-per-node 4 examples/<example> ARGS``, as the README launches it (``python -m
    torch.distributed.run`` is torchrun without relying on the console script; --standalone picks a free port)."""
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                 str(EXAMPLES / example), *args], cwd)


def _floats(pattern: str, output: str) -> list[float]:
    # Not anchored to a line start: another rank's unflushed text could precede it on a shared pipe.
    return [float(x) for x in re.findall(pattern, output)]


def _one(pattern: str, output: str) -> tuple[float, ...]:
    found = re.findall(pattern, output)
    assert len(found) == 1, f"expected one match of {pattern!r} (rank 0 prints it):\n{output}"
    return tuple(float(x) for x in (found[0] if isinstance(found[0], tuple) else (found[0],)))


@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_big_model_materializes_trains_exports_and_loads_back_the_same_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    exported, again = tmp_path / "gpt.safetensors", tmp_path / "again.safetensors"
    out = _torchrun("big_model.py", "--export", str(exported), cwd=tmp_path)
    first, last = _one(r"materialized [\d,]+ parameters; \d+ steps on a .*?; loss ([\d.]+) -> ([\d.]+)", out)
    assert last < first - 0.5, out
    # Load what was exported into a fresh meta-built model and write it back, untrained: the same bits.
    out = _torchrun("big_model.py", "--pretrained", str(exported), "--epochs", "0", "--export", str(again),
                    cwd=tmp_path)
    assert "loaded 220,544 parameters; 0 steps" in out, out
    saved, reloaded = load_file(exported), load_file(again)
    assert saved.keys() == reloaded.keys() and len(saved) > 10
    assert all(saved[k].equal(reloaded[k]) for k in saved), "load_pretrained + export changed the weights"


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_tensor_parallel_trains_two_replicas_with_inter_node_bytes_at_the_floor(tmp_path: Path) -> None:
    # 4 ranks as R=2 replicas of S=1 x T=2: the replicate group is what would cross nodes.
    out = _torchrun("tensor_parallel.py", "--shard", "1", "--preset", "tiny", "--lr", "3e-3", "--steps", "6",
                    cwd=tmp_path)
    assert "HSDPMesh(replicate=2, shard=1, tp=2" in out, out
    losses = _floats(r"step \d+: loss ([\d.]+)", out)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, out
    (ratio,) = _one(r"= ([\d.]+) x the floor", out)
    assert 1.0 <= ratio < 1.03, out  # padding and the "has gradient" flags ride along


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_hf_trainer_trains_checkpoints_and_writes_a_folder_that_reloads(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out = _torchrun("hf_trainer.py", "--steps", "10", "--out", str(out_dir), cwd=tmp_path)
    logged = _floats(r"'loss': '([\d.]+)'", out)  # Trainer's log every 5 steps, rank 0
    assert len(logged) == 2 and logged[1] < logged[0], out
    trained, reloaded = _one(r"trained model loss ([\d.]+), reloaded from \S+ ([\d.]+)", out)
    assert trained == pytest.approx(reloaded, abs=2e-4), out
    assert (out_dir / "checkpoint-10" / "hsdp_model").is_dir(), sorted(p.name for p in out_dir.iterdir())


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_accelerate_loop_trains_saves_state_and_writes_a_folder_that_reloads(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out = _torchrun("accelerate_loop.py", "--out", str(out_dir), cwd=tmp_path)
    epochs = _floats(r"epoch \d: loss ([\d.]+)", out)
    assert len(epochs) == 2 and epochs[1] < epochs[0], out
    trained, reloaded = _one(r"trained model loss ([\d.]+), reloaded from \S+ ([\d.]+)", out)
    assert trained == pytest.approx(reloaded, abs=2e-4), out
    assert (out_dir / "state" / "hsdp_model").is_dir()


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_lightning_trainer_resumes_and_consolidates_into_a_plain_module(tmp_path: Path) -> None:
    out = _torchrun("lightning_trainer.py", "--out", str(tmp_path / "out"), cwd=tmp_path)
    epochs = _floats(r"epoch \d: loss ([\d.]+), \d+ optimizer steps", out)
    assert len(epochs) == 2 and epochs[1] < epochs[0], out
    assert "Restored all states from the checkpoint" in out, out  # the second fit resumed epoch 1
    plain, trained = _one(r"plain LitGPT: loss on 8 sequences ([\d.]+), the trained model's ([\d.]+)", out)
    assert plain == pytest.approx(trained, abs=2e-4), out


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_lightning_fabric_saves_loads_into_fresh_weights_and_trains_on(tmp_path: Path) -> None:
    out = _torchrun("lightning_fabric.py", "--out", str(tmp_path / "ckpt"), cwd=tmp_path)
    (saved,) = _one(r"an hsdp run directory\): loss on a fixed batch ([\d.]+)", out)
    (loaded,) = _one(r"loaded step 2: loss on a fixed batch ([\d.]+)", out)
    assert saved == loaded, out  # fresh weights (another seed) replaced by the checkpoint's, bit for bit
    steps = _floats(r"step \d: loss ([\d.]+), grad norm", out)
    assert len(steps) == 4 and steps[-1] < steps[0], out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_stand_ins(bin_dir: Path) -> None:
    """``srun`` (one node: drops its own options, runs the command once), ``scontrol show hostnames`` (this
    host) and ``python`` (this interpreter) on PATH."""
    bin_dir.mkdir()
    scripts = {
        "srun": 'while [[ $# -gt 0 && $1 == --* ]]; do shift; done\nexec "$@"\n',
        "scontrol": '[[ "$1 $2" == "show hostnames" ]] || exit 2\necho 127.0.0.1\n',
        "python": f'exec "{sys.executable}" "$@"\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_slurm_script_is_valid_bash_and_names_only_commands_that_exist() -> None:
    script = EXAMPLES / "slurm_hsdp.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    code = "\n".join(line.split(" #")[0] for line in script.read_text().splitlines() if not line.startswith("#"))
    # The first word of each command: at a line's start, after $( or a pipe.
    commands = set(re.findall(r"(?:^|\$\(|\|)\s*([a-z][\w.-]*)\s", code, re.MULTILINE))
    builtins, slurm = {"set", "export", "echo"}, {"srun", "scontrol"}
    assert slurm <= commands and "python" in commands, commands
    missing = [c for c in commands - builtins - slurm - {"python"} if shutil.which(c) is None]
    assert not missing, f"the script runs {missing}, not installed here"
    modules = re.findall(r"python -m ([\w.]+)|-m (hsdp[\w.]+)", code)
    assert {m for pair in modules for m in pair if m} == {"torch.distributed.run", "hsdp.apps.train"}, modules
    config = re.search(r"CONFIG=\$\{CONFIG:-([^}]+)\}", code)
    assert config and (ROOT / config[1]).is_file()  # the default config, examples/hsdp_train.toml


@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_slurm_script_trains_with_the_example_config_and_a_requeue_resumes(tmp_path: Path) -> None:
    _slurm_stand_ins(tmp_path / "bin")
    run_dir = tmp_path / "run"
    env = _env(PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="node1",
               SLURM_NNODES="1", SLURM_JOB_NAME="hsdp-test", SLURM_CPUS_PER_TASK="2", GPUS_PER_NODE="2",
               RDZV_PORT=str(_free_port()), RUN_DIR=str(run_dir), COLUMNS="400")  # rich: one line per message
    tiny = ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=0", "train.sample_tokens=0",
            "train.log_every=1", "data.max_bytes=100000"]
    script = str(EXAMPLES / "slurm_hsdp.sbatch")
    # The first submission stops after step 2 as a preempted job would; the requeued one continues.
    first = _run(["bash", script, *tiny, "train.stop_after=2"], ROOT, {**env, "SLURM_JOB_ID": "1"})
    assert "1 nodes x 2 GPUs" in first and "resumed from" not in first, first
    second = _run(["bash", script, *tiny], ROOT, {**env, "SLURM_JOB_ID": "2", "RDZV_PORT": str(_free_port())})
    assert re.search(r"resumed from\s+\S+step_0+2 \(step 2\)", second), second
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], steps
    assert (run_dir / "checkpoints" / "step_000004").is_dir()
