"""The distributed ground floor: process groups and Megatron's rank orders, ``initialize_model_parallel``,
every collective tensorpar issues (:mod:`.comm`, torch's own on any backend), the ledger that
records them, and the fixed-order sums whose bits never depend on the layout (:mod:`.tree_reduce`).

Nothing here knows a layer: the axes above build on it.
"""
