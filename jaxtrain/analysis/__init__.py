"""What a step costs, read from its compiled program: memory and FLOPs, collective traffic, HLO, the largest
batch that fits, post-training int8.
"""
