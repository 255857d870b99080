"""Activation memory: the policy a config asks for (:mod:`.policy`), recompute whose
communication overlaps compute (:mod:`.recompute`), zero-memory activation dropping
(:mod:`.zero_memory`), and the accounting of every saved byte (:mod:`.accounting`)."""
