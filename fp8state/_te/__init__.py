"""TransformerEngine values, decoded without TransformerEngine and without running pickled code.

Private to fp8state, and below both the mixin (``set_extra_state`` accepts every TE form) and
the packages that read whole files (:mod:`fp8state.checkpoint`, :mod:`fp8state.migrate`):
the allow-list unpickler (:mod:`.unpickler`) and the recipe stand-ins it maps TE's classes to
(:mod:`.standins`), the era table (:mod:`.eras`), the one sniffer of TE forms
(:mod:`.sniff`), containers (:mod:`.containers`), per-era decoding (:mod:`.decode`), the
conversion rules to the schema (:mod:`.to_schema`) and the one-value entry point
(:mod:`.extra_state`).
"""
