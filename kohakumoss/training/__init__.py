"""Training: ``optim`` (parameter groups, AdamW / Muon, LR schedule, gradient clipping) and
``ema`` (an fp32 exponential moving average of the trainable weights)."""
