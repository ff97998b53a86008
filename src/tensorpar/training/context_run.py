"""Context parallelism in a training run (``tensorpar train --cp N``): the groups, the loss
scale behind the gradient reduction, and the layout as the header and checkpoints name it.

Every CP rank of a DP rank reads the same samples (the sampler splits over DP only); the GPT,
built with the CP group, runs this rank's chunks of each and returns the micro-batch's mean loss
over *every* token, the same value on each CP rank, and each rank's gradient is its own tokens'
share of it. The gradient reducer averages over DP x CP, so backward runs on the loss times CP:
the average over DP x CP of CP x each share is the DP mean of the shares' sum, CP=1's gradient.
After the reduction weights and gradients are replicated over CP, as over DP: the grad norm
counts each element once, and a checkpoint holds one copy (DCP writes a replicated entry once).

Example::

    layout = ContextLayout.current(cp_comm="p2p")    # after initialize_model_parallel(...)
    model = GPT(config, cp_group=layout.group)
    (model(tokens, labels) * layout.loss_scale).backward()
"""

from __future__ import annotations

import dataclasses

from .. import parallel_state as ps
from ..context_parallel import SequenceChunks


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    """This run's CP size and comm type, the CP group (None at CP 1: the GPT runs without it)
    and ``grad_group``, the DP x CP group weight gradients are reduced over."""

    size: int
    comm_type: str
    group: object
    grad_group: object

    @classmethod
    def current(cls, *, cp_comm: str) -> "ContextLayout":
        """The layout of the initialized model-parallel groups."""
        size = ps.get_context_parallel_world_size()
        if size == 1:
            return cls(1, cp_comm, None, ps.get_data_parallel_group())
        return cls(size, cp_comm, ps.get_context_parallel_group(),
                   ps.get_data_parallel_group(with_context_parallel=True))

    @property
    def loss_scale(self) -> int:
        """What backward multiplies the loss by: the reducer's average over CP undone."""
        return self.size

    def describe(self, *, tp: int, dp: int, seq_len: int, sequence_parallel: bool) -> str:
        """The header's words for the layout: ``TP=2 DP=1``, or with CP ``TP=2 CP=2 (p2p: ...) DP=1``."""
        if self.size == 1:
            return f"TP={tp} DP={dp}"
        chunks = SequenceChunks(seq_len, self.size, 0, tp if sequence_parallel else 1)
        how = "a2a: Ulysses all-to-all" if self.comm_type == "a2a" else "p2p: K/V ring"
        padded = f", padded to {chunks.padded_len}" if chunks.padding else ""
        return (f"TP={tp} CP={self.size} ({how}; each sequence in {2 * self.size} chunks of {chunks.chunk_len} "
                f"tokens{padded}, CP rank i holding chunks i and {2 * self.size - 1}-i) DP={dp}")
