"""The worker side: what runs next to the GPU and moves the bytes.

``layout`` describes the engine's paged KV tensors, ``slab`` the pinned host
memory they are offloaded into, ``plan`` turns load/store specs into the
kernels' index pairs, ``backends`` picks how the copy runs (Triton, DMA, torch)
and ``engine`` submits transfer jobs on CUDA streams; ``cudart`` binds the two
CUDA runtime calls torch does not. These modules import torch; nothing here
imports the manager or the operator tools. docs/worker.md describes the path.
"""
