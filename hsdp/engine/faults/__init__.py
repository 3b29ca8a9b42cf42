"""Faults the engine must survive: dead or stuck ranks (watchdog) and preemption signals."""
