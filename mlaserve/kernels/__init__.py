"""Pure tensor functions (Triton kernels and their float32 torch references).

Nothing here imports anything else from mlaserve.
"""
