"""Expert balancing: EPLB (which experts to copy and where they live, and moving them between
steps) and LPLB (each batch's tokens redistributed over the copies by a linear program, solved
in torch, in C or in Triton). The runtime (:mod:`.runtime`) is what a training rank drives; the
policies, solvers and their figures sit beside it, one concern per module."""
