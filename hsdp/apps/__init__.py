"""Applications: `hsdp train`, the demo and the command line that dispatches to every tool."""
