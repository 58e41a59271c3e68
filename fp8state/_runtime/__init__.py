"""The FP8 mixin's runtime: what :class:`fp8state.FP8StateMixin` and its modules run on.

Private to fp8state. Slot casts (:mod:`.slot_cast`), the batched state-dict staging
(:mod:`.staging`), payload I/O of one module (:mod:`.meta_io`), the end-of-step amax
reduction (:mod:`.amax_reduction`), the buffer-replacement count (:mod:`.generation`), the
buffers' names (:mod:`.buffers`), the friend interface the mixin offers them
(:mod:`.friend`), and activation recomputation: telling it from a forward and replaying each
call's record (:mod:`.recompute`, with the records in :mod:`.forward_record`, each module's
pending ones in :mod:`.replay_log` and the drop-in checkpoint's in :mod:`.replay_scope`).
Nothing here imports the mixin: the runtime sees modules through :class:`.friend.FP8Friend`
only.
"""
