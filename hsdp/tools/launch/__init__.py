"""Launching hsdp jobs. ``launch_local`` emulates several nodes on one machine, one torchrun agent each."""

from hsdp.tools.launch.local import AgentSpec, Supervisor, launch_local, local_agents, torchrun_command

__all__ = ["AgentSpec", "Supervisor", "launch_local", "local_agents", "torchrun_command"]
