"""Files a run writes and the locks around them: atomic writes, digests, free space, one writer per folder; and
what the library logs, shown as a terminal's lines (``console``).

Imports nothing of jaxtrain but the ground (``errors``, ``settings``).
"""
