"""The engine: request state, the step planner, the model runner, overlap, sampling, grammar, spec decode, LoRA, outputs."""
