"""The invariant mode (``GPTConfig(tp_invariant=True)``): every floating-point sum in an order, every
GEMM in a shape, that does not depend on the layout, so every TP size trains the same bits.

Its layers (:mod:`.layers`), mixture-of-experts layer (:mod:`.experts`), dropout keyed by
global position (:mod:`.dropout`) and elementwise kernels that take one path for every element
(:mod:`.lanewise`); its cross-rank sums are :mod:`tensorpar.distributed.tree_reduce`'s.

Example::

    from tensorpar import invariant

    fc = invariant.ColumnLinear(h, 4 * h, blocks=8)
"""

from .experts import MoELayer
from .layers import (BlockRowsLinear, ColumnLinear, LayerNorm, RMSNorm, RowLinear, check_gpt_sizes, check_layer,
                     kv_for_query_heads, vocab_parallel_cross_entropy)

__all__ = ["BlockRowsLinear", "ColumnLinear", "LayerNorm", "MoELayer", "RMSNorm", "RowLinear", "check_gpt_sizes",
           "check_layer", "kv_for_query_heads", "vocab_parallel_cross_entropy"]
