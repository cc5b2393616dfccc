"""Training: what a run is built of and how it runs.

``build`` (``build_components``: the model with its engines, the trainable set, the
optimizer, schedule, EMA, the stepper, caches and batches), ``engines`` (``EnginePlan``,
``apply_engines``: precision, kernels, memory, placement; kernel tuning), ``steppers`` (how
gradients become the update: device, streamed, fused, host, sharded), ``trainer`` (the
loop, checkpoints and resume), ``trainable`` (a full finetune or an adapter set), ``optim``
(parameter groups, AdamW / Muon, LR schedule, gradient clipping), ``ema``, ``inputs`` and
``encode`` (a batch's packed inputs), ``ahead`` (the next micro-batch made meanwhile),
``autoprofile`` and ``estimate`` (the memory profile and its estimate), ``checkpoint``,
``statefile`` and ``verified`` (checkpoint files), ``trained`` (a checkpoint applied to a
model), ``metrics`` and ``previews``."""
