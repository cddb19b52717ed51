"""Imported first by the process that forks the ranks: it outlives a stop sent to the job's whole process group."""

import signal

# The launcher reads each rank's exit code through this process: ended by a signal meant for the job (a
# terminal's Ctrl-C while it imports torch, a scheduler's SIGTERM to every process of it), it would report
# every rank as failed while they still save. Each rank restores the defaults (forked.run).
for _signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(_signum, signal.SIG_IGN)
