"""Exports: ComfyUI LoRA files (``comfy``), LyCORIS files, merged models and diffusers
transformer folders, from a training checkpoint or a foreign adapter file."""
