"""The FP8 mixin's runtime: what :class:`fp8state.FP8StateMixin` and its modules run on.

Private to fp8state. Slot casts (:mod:`.slot_cast`), the batched state-dict staging
(:mod:`.staging`), payload I/O of one module (:mod:`.meta_io`), the end-of-step amax
reduction (:mod:`.amax_reduction`), the buffer-replacement count (:mod:`.generation`), the
buffers' names (:mod:`.buffers`) and the friend interface the mixin offers them
(:mod:`.friend`). Nothing here imports the mixin: the runtime sees modules through
:class:`.friend.FP8Friend` only.
"""
