"""The kernel-common layer: what more than one kernel traces.

* :mod:`.barriers`: the named-barrier ids of every kernel, in one enum;
* :mod:`.seqinfo`: the per-sequence kernel arguments and the in-kernel sequence description
  (offsets clamped to the tensors, lengths, the runtime mask of one sequence);
* :mod:`.tile_scheduler`: linear tile index -> (block, head, batch) walks and the persistent
  snake order;
* :mod:`.silu`: SiLU and its gradient (MUFU tanh / exp2 forms);
* :mod:`.mask_apply`: zeroing masked accumulator elements, in the query-major and key-major
  orientations;
* :mod:`.sm80` / :mod:`.sm90`: the arch-specific fragment, copy and pipeline helpers.

Nothing here imports the host layers (launch, validation, compile keys, cache).
"""
