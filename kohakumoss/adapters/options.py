"""The adapter section's own rules, pure config (no torch, no LyCORIS): which algorithms
there are and which options go with which. ``kmoss scan`` checks them when params load;
``apply_adapters`` checks them again before it builds anything."""

from __future__ import annotations

# LyCORIS's network module of each algorithm (``apply_adapters`` builds with these)
NETWORK_MODULE = {"lora": "lora", "locon": "locon", "dora": "lora", "loha": "loha",
                  "lokr": "lokr", "oft": "diag-oft", "boft": "boft", "glora": "glora",
                  "ia3": "ia3", "dylora": "dylora", "tlora": "tlora"}
DORA_ALGOS = ("lora", "locon", "loha", "lokr", "dora")


def check_options(cfg) -> None:
    """An ``AdapterConfig``'s algorithm and options go together (a ValueError naming the
    option and the fix when not)."""
    if cfg.full:
        raise ValueError("adapter.algo 'full' is a full finetune, not an adapter: train the "
                         "model's own parameters instead of calling apply_adapters")
    if cfg.algo not in NETWORK_MODULE:
        raise ValueError(f"adapter.algo {cfg.algo!r}: one of {', '.join(NETWORK_MODULE)}, full")
    if cfg.dora and cfg.algo not in DORA_ALGOS:
        raise ValueError(f"adapter.dora works with {', '.join(DORA_ALGOS)}, not {cfg.algo!r}")
    if (cfg.dora or cfg.algo == "dora") and cfg.dropout > 0:
        raise ValueError("DoRA ignores input dropout: set adapter.dropout to 0 (rank and "
                         "module dropout still work)")
    if cfg.algo == "oft" and cfg.dropout > 0:
        raise ValueError("LyCORIS 4.1.3's OFT input dropout fails (its mask does not fit the "
                         "rotation blocks): set adapter.dropout to 0 for oft (rank_dropout and "
                         "module_dropout work)")
    if cfg.algo == "tlora" and cfg.mode == "merge":
        raise ValueError("T-LoRA's per-token rank masks need adapter.mode 'bypass'")
