"""The exit status of a rank that hsdp ends because of a fault (a dead, hung or orphaned peer or itself).

Distinct from a Python error (1), a usage error (2) and preemption (143), so a launcher or a scheduler's
retry policy can tell "the job's fault handling stopped it" apart. 75 is ``EX_TEMPFAIL``: try again.
"""

EXIT_CODE = 75
