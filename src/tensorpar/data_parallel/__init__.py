"""Data parallelism composed with the other axes: the DP x CP reduction of ``main_grad``, fp32
master weights, the grad norm and clipping counted once over every axis (:mod:`.grads`), and
sharded data parallelism through torch's FSDP2 and its meshes (:mod:`.fsdp`, :mod:`.fsdp_mesh`).
"""
