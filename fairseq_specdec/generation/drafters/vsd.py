"""The ``specdec_vsd`` drafter: drafts from the verifier's own states."""
import torch
from torch import Tensor

from ...kernels import rowgemm
from ...utils.dictionary import joined_dictionaries
from ...utils.projection import WeightsWatch
from ..tree import tree_from_candidates
from .vsd_native import NativeBlockPass, native_block_pass_reason
from .base import NO_KERNELS, DraftKernels, Drafter, StaticDrafter, TimedParts, TreeDrafter
from .shortlist import TREE_CANDIDATES, ShortlistProjection


class VerifierStateDrafter(Drafter, TreeDrafter, StaticDrafter, TimedParts):
    """The ``specdec_vsd`` drafter: drafts k tokens from the verifier's own
    work (its encoder output, and the final decoder state that predicted each
    row's newest token, handed over in every :class:`Feedback`), in one pass
    of ``1 + k`` rows; see :mod:`fairseq_specdec.models.specdec_vsd`.

    Per batch it projects the cross-attention memory once and picks the
    shortlist (:class:`ShortlistProjection`: the ``shortlist`` most frequent
    types plus the batch's source tokens when source and target share the
    dictionary).  It returns drafts with their (shortlist) log-probs, so the
    confidence cut of ``--draft-min-confidence`` applies.

    ``kernels``: what it may compute with the plugin's kernels (the
    backend's choice): its pass through :class:`NativeBlockPass` and its
    shortlist through packed products, in ``kernels.precision``."""

    def __init__(self, model, verifier_model, shortlist: int = 0, source: str = "--drafter-path",
                 kernels: DraftKernels = NO_KERNELS):
        model.check_verifier(verifier_model, source)
        self.model = model
        self.kernels = kernels
        self.max_block = model.offsets.num_embeddings  # one slot offset per drafted token
        self.projection = ShortlistProjection(
            shortlist, model.num_types, joined_dictionaries(verifier_model), (model.padding_idx, model.dictionary.bos()),
            kernels,
        )
        #: the drafting pass through the kernels, where the backend allows it and they run
        self.native = None
        if kernels.block and native_block_pass_reason(model) is None:
            self.native = NativeBlockPass(model, kernels.precision)
        self.memory = None
        self.ctx_states = None
        self.static = False
        self._static = {}  # (rows, source bucket, dtype) -> fixed memory and context buffers
        self._key = ()
        self._extra = 0  # the shortlist's padded count of the batch's extra source types
        self._weights = WeightsWatch()  # the model's weights; its generation joins the graphs' key

    #: positions of a batch's first table of slot rows (eager passes): it
    #: grows, doubling, once a row's slots reach past it (:meth:`_cover`)
    FIRST_POSITIONS = 32

    def start_batch(self, state) -> None:
        model = self.model
        # eager passes make the rows' source memory at their first draft
        # (_source_memory): a batch whose rows the loop keeps from drafting
        # until most have finished never makes, nor reorders, the memory of
        # the finished ones; the fixed buffers of static passes need it now
        self.memory = model.source_memory(state.encoder_out, positions=0) if self.static else None
        self.ctx_states = model.start_state.unsqueeze(0).expand(state.size, -1)
        self.projection.start_batch(model.output_weight, None, state.net_input["src_tokens"])
        if self.static:
            self._extra = self.projection.make_static()
            # a graph captured with other weights reads their old layouts: a new key
            self._weights.changed(model.parameters())
            self._to_static()

    def static_inputs(self) -> bool:
        self.static = True
        return True

    def static_key(self) -> tuple:
        return self._key

    def _to_static(self) -> None:
        """The rows' source memory padded to a multiple of 16 source tokens
        (the padding masked for the block layers' cross-attention and for
        the soft copy), and their context states, in fixed buffers (the
        shortlist's are made once per batch, in start_batch)."""
        memory, ctx = self.memory, self.ctx_states
        rows, length = memory["copy_values"].shape[:2]
        padded = -(-length // 16) * 16
        key = (rows, padded, ctx.dtype)
        if key not in self._static:
            self._static[key] = {
                "layers": [tuple(torch.zeros(t.shape[:2] + (padded,) + t.shape[3:], dtype=t.dtype, device=t.device)
                                 for t in pair) for pair in memory["layers"]],
                "mask": torch.zeros(rows, 1, 1, padded, dtype=torch.bool, device=ctx.device),
                "copy_keys": memory["copy_keys"].new_zeros(memory["copy_keys"].shape[:2] + (padded,)),
                "copy_values": memory["copy_values"].new_zeros((rows, padded) + memory["copy_values"].shape[2:]),
                "copy_pad": torch.ones(rows, 1, padded, dtype=torch.bool, device=ctx.device),
                "ctx": torch.empty_like(ctx),
            }
        buf = self._static[key]
        for pair, static_pair in zip(memory["layers"], buf["layers"]):
            for t, static in zip(pair, static_pair):  # N x H x S x d
                static.zero_()
                static[:, :, :length] = t
        buf["mask"].fill_(False)
        buf["mask"][..., :length] = memory["mask"]
        buf["copy_keys"].zero_()
        buf["copy_keys"][..., :length] = memory["copy_keys"]
        buf["copy_values"].zero_()
        buf["copy_values"][:, :length] = memory["copy_values"]
        buf["copy_pad"].fill_(True)
        buf["copy_pad"][..., :length] = memory["copy_pad"]
        buf["ctx"].copy_(ctx)
        self.memory = {name: buf[name] for name in ("layers", "mask", "copy_keys", "copy_values", "copy_pad")}
        self.ctx_states = buf["ctx"]
        self._key = (rows, padded, self._extra, self._weights.generation)

    def update(self, state, feedback) -> None:
        if self.static:
            self.ctx_states.copy_(feedback.newest_states())
        else:
            self.ctx_states = feedback.newest_states()

    def _cover(self, state, k: int) -> None:
        """Grow the batch's table of slot rows (``copy_base``) until it holds
        every slot of this pass (positions up to the longest row's length +
        k - 1), doubling, up to the batch's width and the model's position
        table: the slots then read the rows that a table of the whole width
        holds, and the first, short table spares the soft copy of positions
        no row reaches."""
        table = self.memory["copy_base"]
        size = table.size(1)
        need = max(state.lengths_host) + k
        most = min(state.width, self.model.positions.num_embeddings)
        if need > size and size < most:
            self.memory["copy_base"] = self.model.position_table(self.memory, min(max(2 * size, need), most))

    def _source_memory(self, state) -> None:
        """The active rows' source memory (eager passes), from the state's
        encoder output, which holds exactly the active rows; with the
        slots' first position table."""
        if self.memory is None:
            self.memory = self.model.source_memory(state.encoder_out,
                                                   positions=min(state.width, self.FIRST_POSITIONS))

    def _block_states(self, state, k: int) -> Tensor:
        """The drafter's B x k final states of one pass: one per drafted position."""
        if not self.static:
            self._source_memory(state)
            self._cover(state, k)
        tokens = state.last_tokens().squeeze(1)
        if self.native is not None and not self.static:
            states = self.native.block_states(self.memory, self.ctx_states, tokens, state.lengths, k)
        else:
            states = self.model.block_states(self.memory, self.ctx_states, tokens, state.lengths, None, k)
        return states

    def propose(self, state, k):
        return self.projection.pick(self._block_states(state, k))

    def propose_tree(self, state, k, nodes):
        types, lprobs = self.projection.top(self._block_states(state, k), TREE_CANDIDATES)
        return tree_from_candidates(types, lprobs, nodes, self.model.padding_idx)

    #: the default draft length where the row-blocked kernel computes the
    #: passes: with the demo's drafter, drafts of 4-5 tokens added few
    #: accepted tokens over 3 and were no faster, although a pass of up to
    #: 8 rows reads each weight once (docs/verify-kernels.md, "Register blocks
    #: for 5 to 8 rows")
    KERNEL_BLOCK = 3

    def default_block(self, trained: int) -> int:
        """Where the products run through the row-blocked kernel, at most
        :attr:`KERNEL_BLOCK` (a drafting pass of 1 + k rows and a verify pass
        of k + 1 rows each read every weight once; longer drafts are mostly
        rejected); elsewhere the training k."""
        if not self.kernels.products:
            return trained
        return rowgemm.fitting_block(self.model.output_weight, trained, self.KERNEL_BLOCK)

    def describe(self) -> str:
        shortlist = self.model.cfg.shortlist
        return (f"specdec_vsd drafter reading the verifier's states (shortlist {shortlist or 'off'}, "
                f"{'native kernels, ' + self.kernels.precision + ' weights' if self.native is not None else 'torch operations'})")

    def timed_parts(self, k: int):
        yield self, "start_batch", "drafter start of batch (memory from the verifier's encoder output)"
        yield self, "propose", f"drafter pass (1 + up to {k} rows, shortlist projection)", False
        yield self, "propose_tree", f"drafter tree (1 + up to {k} rows, top candidates, best prefixes)", False
        if self.native is not None:
            yield self.native, "block_states", "of which: drafter block layers (native)", False
        else:
            yield self.model, "block_states", "of which: drafter block layers", False
        yield self, "update", "drafter feedback (the verifier's state)"

    def reorder(self, order, order_host) -> None:
        if self.memory is not None:  # (else made for the kept rows when they first draft)
            self.memory = self.model.select_memory(self.memory, order)
        self.ctx_states = self.ctx_states.index_select(0, order)
        if self.static:  # the kept rows, into the buffers of their number
            self._to_static()
