"""Files a run writes and the locks around them: atomic writes, digests, free space, one writer per folder.

Imports nothing of jaxtrain but the ground (``errors``, ``settings``).
"""
