"""What a layout costs, by job: `compiled` (read from the compiled program), `predicted` (the analytic model and
the step time), `planning` (`shardkit plan` and its page), `search` (`shardkit suggest`)."""
