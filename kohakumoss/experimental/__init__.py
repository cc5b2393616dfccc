"""Opt-in backends the core never imports: each subpackage registers its backends in the
kernel registry when imported, and is imported only where ``kernels.backends`` names it
(``kohakumoss.kernels.registry.load_experimental``: the name ``tilelang`` loads
``kohakumoss.experimental.tilelang``). They stay out of every default: what they were measured
at is in ``docs/history.md``."""
