"""Pipeline schedules as data and the executor that runs them: the IR and the schedules
(1F1B, ZB1P, interleaved, DualPipe, DualPipeV), their validator, simulator and plot, the
executor over the stage contract, the F&B overlap, the exchanges and the W queue."""
