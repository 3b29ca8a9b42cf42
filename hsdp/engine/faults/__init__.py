"""Faults the engine must survive: dead or stuck ranks (watchdog) and the signals that stop a job."""
