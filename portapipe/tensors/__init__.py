"""Tensor helpers below every package that computes: what several of them do to a tensor's memory
(:mod:`.storage`), kept here so that none of them imports another for it."""
